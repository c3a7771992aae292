"""Routing policies: pure functions of (request, fleet view, time) plus event hooks. One file per policy."""
