"""The client actor: a DEALER to the coordinator (actor.py) or, in direct mode, the one engine
rank's own coordinator (direct.py); runtime/client.py wraps it in Client / AsyncClient."""
