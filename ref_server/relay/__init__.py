"""The hub's weight relay and weight-sync rendezvous over HTTP: the FastAPI routes only (``routes.py``); the relay
store and the rendezvous they call are in :mod:`shared.weight_sync`."""
