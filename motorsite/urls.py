from django.contrib import admin
from django.urls import include, path

from serving import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/", include("serving.urls")),
    path("healthz", views.healthz),
]
