from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.accounts import api as accounts_api
from apps.catalog import api as catalog_api
from apps.cluster import api as cluster_api
from apps.quotas import api as quotas_api
from llmgw import ops
from llmgw.api import StatusView, router
from llmgw.console import views as console

router.register("keys", accounts_api.ApiKeyViewSet, basename="apikey")
router.register("organizations", accounts_api.OrganizationViewSet, basename="organization")
router.register("teams", accounts_api.TeamViewSet, basename="team")
router.register("projects", accounts_api.ProjectViewSet, basename="project")
router.register("nodes", cluster_api.NodeViewSet, basename="node")
router.register("models", catalog_api.ModelViewSet, basename="model")
router.register("replicas", catalog_api.ReplicaViewSet, basename="replica")
router.register("limits", quotas_api.RateLimitViewSet, basename="ratelimit")

api_urlpatterns = [
    path("me", accounts_api.MeView.as_view(), name="api-me"),
    path("status", StatusView.as_view(), name="api-status"),
    path("nodes/enrollments", cluster_api.NodeEnrollmentView.as_view(), name="api-node-enrollments"),
    path("agent/enroll", cluster_api.AgentEnrollView.as_view(), name="api-agent-enroll"),
    path("usage", quotas_api.UsageView.as_view(), name="api-usage"),
    path("requests/<str:request_id>", quotas_api.RequestView.as_view(), name="api-request"),
    path("schema", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("", include(router.urls)),
]

urlpatterns = [
    path("", console.landing, name="landing"),
    path("login/", auth_views.LoginView.as_view(template_name="console/login.html", redirect_authenticated_user=True),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("_lang/<str:code>", console.set_language, name="set-language"),
    path("account/keys/", console.api_keys, name="api-keys"),
    path("nodes/", include("apps.cluster.urls")),
    path("models/", include("apps.catalog.urls")),
    path("api/v1/", include(api_urlpatterns)),
    path("django-admin/", admin.site.urls),
    path("metrics", ops.metrics, name="metrics"),
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
]
