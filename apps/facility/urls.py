from __future__ import annotations

from django.urls import path

from apps.facility import views

app_name = "facility"

urlpatterns = [
    path("", views.facility, name="facility"),
    path("hold", views.hold, name="hold"),
    path("release", views.release, name="release"),
    path("budget", views.budget, name="budget"),
    path("budget/remove", views.remove_budget, name="budget-remove"),
]
