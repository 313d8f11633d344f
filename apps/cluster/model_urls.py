from __future__ import annotations

from django.urls import path

from apps.cluster import model_views as views

# The models' pages are the cluster app's (they show replicas and placement); their URL names stay
# "catalog:..." as links and templates know them.
app_name = "catalog"

urlpatterns = [
    path("", views.models, name="models"),
    path("apply", views.model_apply, name="model-apply"),
    path("<str:name>/", views.model_detail, name="model"),
    path("<str:name>/explain", views.model_explain, name="model-explain"),
    path("<str:name>/target", views.model_target, name="model-target"),
    path("<str:name>/class", views.model_class, name="model-class"),
    path("<str:name>/owner", views.model_owner, name="model-owner"),
    path("<str:name>/resources", views.model_resources, name="model-resources"),
    path("<str:name>/delete", views.model_delete, name="model-delete"),
]
