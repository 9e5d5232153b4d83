"""Dynamic batching of one served model version, by concern: ``batcher`` (:class:`Batcher`, the loop that puts the
parts together), ``request_queue`` (admission, priority levels, expiry), ``forming`` (batch size and the wait for
company), ``dispatch`` (engine instances and their inference threads), ``turns`` (turns on the cores), ``settings``
and ``tuning`` (batch sizes and layouts chosen from measured figures). Import each name from the module that
defines it."""
