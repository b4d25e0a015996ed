from django.apps import AppConfig


class CatalogConfig(AppConfig):
    name = "catalog"
    # The label of the app these models were first created in: their tables (serving_*), migration
    # history, content types and admin URLs keep their names, so no database changes when the
    # package moved out of the data plane's ``serving``.
    label = "serving"
    verbose_name = "Serving"
