"""The router daemon: admission, queue, policies, fleet view, dispatch, metrics (asyncio + grpc.aio)."""
