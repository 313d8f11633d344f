from __future__ import annotations

from django.urls import path

from apps.fabrics import views

app_name = "fabrics"

urlpatterns = [
    path("", views.fabrics, name="fabrics"),
    path("nvlink/", views.nvlink, name="nvlink"),
    path("<str:fabric>/", views.fabric, name="fabric"),
]
