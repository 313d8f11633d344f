from __future__ import annotations

from django.urls import path

from apps.cluster import views

app_name = "cluster"

urlpatterns = [
    path("", views.nodes, name="nodes"),
    path("add/", views.node_add, name="node-add"),
    path("<str:name>/", views.node_detail, name="node"),
    path("<str:name>/cordon", views.node_cordon, name="node-cordon"),
    path("<str:name>/uncordon", views.node_uncordon, name="node-uncordon"),
    path("<str:name>/drain", views.node_drain, name="node-drain"),
    path("<str:name>/location", views.node_location, name="node-location"),
    path("<str:name>/doctor", views.node_doctor, name="node-doctor"),
    path("<str:name>/doctor/run", views.node_doctor_run, name="node-doctor-run"),
]
