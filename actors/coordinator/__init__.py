"""The coordinator actor (DESIGN.md §7): routes requests by prefix (routing.py), owns the
lifecycle FSM (fsm.py over messages/lifecycle.py's table; control.py runs its rounds), relays
outputs (relay.py), merges stats (stats.py); core.py is its pure core, check.py its replay."""
