"""Tests of io_loop/connectors/jetstream/ (the suite mirrors the code's rooms: tests/README.md)."""
