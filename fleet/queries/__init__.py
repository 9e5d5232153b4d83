"""The fleet's queries and writes by area, in a caller's session, beneath the area services (fleet.service):
``devices`` (the registry), ``models`` (the builds held) and ``ingest`` (what device messages write). Rows come back
typed (the ORM's rows, read and changed in the caller's session, or small frozen records); nothing here builds an
answer: the services turn rows into the API's schema models. The rollout area keeps its own beside its rules
(fleet.rollout.queries)."""
