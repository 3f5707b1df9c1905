"""Temporary: ``ref_server/routes/weights.py`` (moving to ``ref_server/relay/`` on the weight-sync branch) still
imports the route helpers from here; they live in :mod:`ref_server.http`. Delete this file with that move."""

from ref_server.http import OCTET, State, binary_body

__all__ = ["OCTET", "State", "binary_body"]
