from __future__ import annotations

from django.urls import path

from apps.mirror import views

app_name = "mirror"

urlpatterns = [
    path("", views.held, name="held"),
    path("explore", views.explore, name="explore"),
    path("fetch", views.fetch, name="fetch"),
    path("<id:pk>/remove", views.remove, name="remove"),
    path("<id:pk>/serve", views.serve, name="serve"),
    path("adapters/<str:model>/attach", views.adapter_attach, name="adapter-attach"),
    path("adapters/<str:model>/detach", views.adapter_detach, name="adapter-detach"),
]
