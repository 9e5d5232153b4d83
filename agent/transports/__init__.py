"""The agent's transports: the ways a request reaches the core. KServe v2 over HTTP (:mod:`.http`, with
``/infer/image``: :mod:`.image`, its OpenAPI document: :mod:`.openapi`) and gRPC (:mod:`.grpc`), the local socket
(:mod:`.local`, its client :mod:`.local_client`), system shared memory (:mod:`.shm`), the peer's identity
(:mod:`.peer`) and the wire format they share (:mod:`.kserve`). They import the core; the core imports none of
them."""
