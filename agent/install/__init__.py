"""The install room: how a bundle becomes a served version on this device. The install job and its states
(:mod:`.job`, :mod:`.states`), the store of staged bundles and the trusted record (:mod:`.store`, :mod:`.trusted`),
the trials that choose how it runs here (runtime, precision, layout: :mod:`.runtime_choice`, :mod:`.precision`,
:mod:`.timed_choice`, :mod:`.bench`), its self-test (:mod:`.selftest`, :mod:`.verify`) and a pipeline's
preparation (:mod:`.pipeline`). It builds on the core (agent.core); the core imports nothing from here."""
