"""``runstack`` (what ``make run`` runs) and ``demo_fleet`` (the fleet it serves)."""
