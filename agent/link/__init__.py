"""The agent's link to its fleet: the MQTT session (:mod:`.mqtt`) and its spool of reports kept while offline
(:mod:`.spool`), bundle downloads (:mod:`.updater`, over :mod:`.fetch`) checked against the fleet's signed time
(:mod:`.clock`), the device's telemetry (:mod:`.telemetry`) and enrollment (:mod:`.enroll`). It imports no serving
code: the daemon joins it to the core and the install."""
