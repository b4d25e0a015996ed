"""The fleet: engine instances, their breakers and probes; admin, REST API, presenters, services, Celery tasks."""
