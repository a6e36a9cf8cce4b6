"""The connectors: each feed kind that is not a user's own source, in a room of its own (bytewax's ``connectors/``):
``jetstream`` (the NATS client behind one transport, its source, sink, probe, positions, leases and objects) and
``websocket`` (the WebSocket feed: its client, connecting, the connect hooks, the embedded demo feed).

Rules:
- A room of ``forkless.io_loop``: each module is imported by its full name
  (``forkless.io_loop.connectors.connector``); this ``__init__`` imports nothing, so importing one module of the
  room loads only what that module imports.
- The composition root talks to a connector through ``connector.py``'s protocols (a source factory, a position
  codec, a partition owner with its fence, a probe, a sink), never to the modules of a connector's room.
- Part of the leaf: nothing here imports ``controller``.
"""
