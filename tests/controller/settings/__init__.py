"""Tests of controller/settings/ (the suite mirrors the code's rooms: tests/README.md)."""
