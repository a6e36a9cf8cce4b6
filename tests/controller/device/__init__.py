"""Tests of controller/device/ (the suite mirrors the code's rooms: tests/README.md)."""
