"""The weight relay's router until it moves to ``ref_server/relay/`` (the other jobs' routers live in
``ref_server/hub/`` and ``ref_server/scoring/``; health and metrics in ``ref_server/operations.py``)."""
