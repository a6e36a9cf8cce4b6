"""Tests of io_loop/connectors/websocket/ (the suite mirrors the code's rooms: tests/README.md)."""
