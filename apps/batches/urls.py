from __future__ import annotations

from django.urls import path

from apps.batches import views

app_name = "batches"

urlpatterns = [
    path("", views.batches, name="batches"),
    path("<str:pk>/", views.batch_detail, name="batch"),
    path("<str:pk>/cancel", views.batch_cancel, name="batch-cancel"),
    path("<str:pk>/<str:which>.jsonl", views.batch_file, name="batch-file"),
]
