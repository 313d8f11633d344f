from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from django.utils.csp import CSP
from django.views.decorators.csp import csp_override
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from apps.accounts import api as accounts_api
from apps.accounts import audit_views, key_views, oidc
from apps.accounts import views as accounts_views
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
router.register("quotas", quotas_api.CapacityQuotaViewSet, basename="capacityquota")
router.register("audit", accounts_api.AuditEventViewSet, basename="audit")

# Swagger UI's bundle sets inline styles, so its page alone allows them. Its start-up script
# is served as a file (the split view), so script-src stays as strict as everywhere else.
api_docs = csp_override({**settings.SECURE_CSP, "style-src": [CSP.SELF, CSP.UNSAFE_INLINE]})(
    SpectacularSwaggerSplitView.as_view(url_name="api-schema")
)

api_urlpatterns = [
    path("me", accounts_api.MeView.as_view(), name="api-me"),
    path("status", StatusView.as_view(), name="api-status"),
    path("nodes/enrollments", cluster_api.NodeEnrollmentView.as_view(), name="api-node-enrollments"),
    path("agent/enroll", cluster_api.AgentEnrollView.as_view(), name="api-agent-enroll"),
    path("usage", quotas_api.UsageView.as_view(), name="api-usage"),
    path("requests/<str:request_id>", quotas_api.RequestView.as_view(), name="api-request"),
    path("schema", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs", api_docs, name="api-docs"),
    path("", include(router.urls)),
]

urlpatterns = [
    path("", console.landing, name="landing"),
    path("login/", accounts_views.sign_in, name="login"),
    path("signup/", accounts_views.sign_up, name="signup"),
    path("signup/done/", accounts_views.sign_up_done, name="signup-done"),
    # Signing out also ends the provider's session for people who came through single sign-on.
    path("logout/", oidc.SsoLogoutView.as_view(), name="logout"),
    path("oidc/failed/", oidc.sign_in_failed, name="sso-failed"),
    path("oidc/", include("mozilla_django_oidc.urls")),
    path("_lang/<str:code>", console.set_language, name="set-language"),
    path("account/", key_views.account, name="account"),
    path("account/keys/", key_views.api_keys, name="api-keys"),
    path("connect/<str:tool>.sh", key_views.connect_script, name="connect-script"),
    path("audit/", audit_views.audit, name="audit"),
    path("nodes/", include("apps.cluster.urls")),
    path("models/", include("apps.catalog.urls")),
    path("api/v1/", include(api_urlpatterns)),
    # The admin signs in through /login/, under the same bounds as everyone else.
    path("django-admin/login/", accounts_views.admin_sign_in),
    path("django-admin/", admin.site.urls),
    path("metrics", ops.metrics, name="metrics"),
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
]
