from django.contrib import admin
from django.urls import path

from fleet.views import dashboard
from motorsite.api import api
from serving import views, views_internal

# The admin is the fleet's console: titled for the project, not "Django administration".
admin.site.site_header = "motorsite fleet administration"
admin.site.site_title = "motorsite admin"
admin.site.index_title = "Fleet, models and keys"

# /v1 is not here: motorsite/asgi.py sends it to the edge (serving/edge) before Django sees it.
urlpatterns = [
    # Before admin/: the admin would answer its own 404 for an unknown fleet/ page.
    path("admin/fleet/dashboard/", admin.site.admin_view(dashboard), name="fleet-dashboard"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    path("healthz", views.healthz),
    path("internal/metaserver/<str:token>", views_internal.metaserver_callback),
    path("metrics", views.prometheus_metrics),
]
