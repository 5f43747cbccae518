"""The one stage runtime: the NATS connection and server, the continuous pull, the worker that
decodes, handles, publishes and acks, cancels, failures, and CPU priority."""
