"""The disaggregated DFlash service: gRPC ingress, verifier and drafter replicas on Ray Serve, Redis sessions.

Data path of one Generate call: ingress.py (validate, session) -> verifier.py (the engine's loop) ->
drafter_client.py (gRPC, failover) -> drafter_server.py (draft caches rebuilt from the context log).
"""
