from django.urls import path

from serving import views

urlpatterns = [
    path("models", views.models),
    path("chat/completions", views.chat_completions),
    path("completions", views.completions),
]
