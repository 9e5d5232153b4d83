"""The fleet's HTTP routes, one module per area, each a ``router(fleet)`` that ``fleet.api.create_app`` includes:

- ``health``: liveness, what an agent needs to start (bootstrap), and the counters (stats)
- ``devices``: registration, labels, enrollment, decommission, a device's telemetry and drift, groups
- ``models``: the builds, bundle upload, delegated signing, and the TUF repository agents download from
- ``rollouts``: rollouts, their actions, drift and audit trail
- ``tokens``: API tokens (admin)
- ``console``: the web console's pages and forms (HTML; not in the OpenAPI document)

``context`` holds what they share: the ``Fleet`` they serve from, the role dependencies, common field types.
"""
