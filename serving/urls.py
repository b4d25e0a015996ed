from django.urls import path, re_path

from serving import views

urlpatterns = [
    path("models", views.models),
    path("chat/completions", views.chat_completions),
    path("completions", views.completions),
    path("responses", views.responses),
    path("messages", views.messages),
    re_path(r"^(?P<path>.*)$", views.not_found),
]
