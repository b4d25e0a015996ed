"""The launcher's Django-facing half: ``manage.py runstack``, the render restarter, the process records.

The Django-free half (``motorsite.supervisor``, ``processes``, ``restarts``, ``stack``, ``tiers``)
starts, health-checks, restarts and stops the processes; it runs before any settings exist and
test subprocesses import it alone. This package adds what needs the database: the
``ManagedProcess`` rows and instance history the admin shows (``records``), the graceful render
sidecar restart driven by the render config (``render_restarter``), the command that joins
them (``management/commands/runstack.py``, what ``make run`` runs) and the one that registers
the demo fleet it serves (``demo_fleet``).
"""
