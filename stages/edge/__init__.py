"""The edge: the client's door. OpenAI-compatible HTTP/SSE, the websocket, runs, metrics, keys and
admission; `app` assembles the routes, which import only `core` and `errors`."""
