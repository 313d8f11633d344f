from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import URLPattern, URLResolver, include, path, register_converter
from django.utils.csp import CSP
from django.views.decorators.csp import csp_override
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from apps.accounts import api as accounts_api
from apps.accounts import audit_views, key_views, oidc, people_views
from apps.accounts import views as accounts_views
from apps.batches import api as batches_api
from apps.cluster import api as cluster_api
from apps.cluster import model_api
from apps.cluster import views as cluster_views
from apps.fabrics import api as fabrics_api
from apps.facility import api as facility_api
from apps.gateway import views as chat_views
from apps.guardrails import api as guardrails_api
from apps.guardrails import views as guardrails_views
from apps.mirror import api as mirror_api
from apps.quotas import api as quotas_api
from apps.quotas import people as quotas_people
from apps.quotas import views as usage_views
from apps.sim import api as sim_api
from apps.sim import views as sim_views
from llmgw import ops
from llmgw.api import StatusView, router
from llmgw.console import about, docs
from llmgw.console import views as console
from llmgw.ids import IdConverter

# `<id:pk>`: ASCII digits naming an id the column can hold; anything else matches nothing (404).
register_converter(IdConverter, "id")

router.register("keys", accounts_api.ApiKeyViewSet, basename="apikey")
router.register("organizations", accounts_api.OrganizationViewSet, basename="organization")
router.register("teams", accounts_api.TeamViewSet, basename="team")
router.register("projects", accounts_api.ProjectViewSet, basename="project")
router.register("nodes", cluster_api.NodeViewSet, basename="node")
router.register("models", model_api.ModelViewSet, basename="model")
router.register("replicas", model_api.ReplicaViewSet, basename="replica")
router.register("limits", quotas_api.RateLimitViewSet, basename="ratelimit")
router.register("quotas", quotas_api.CapacityQuotaViewSet, basename="capacityquota")
router.register("audit", accounts_api.AuditEventViewSet, basename="audit")
router.register("batches", batches_api.BatchViewSet, basename="batch")

# Swagger UI's bundle sets inline styles, so its page alone allows them. Its start-up script
# is served as a file (the split view), so script-src stays as strict as everywhere else.
api_docs = csp_override({**settings.SECURE_CSP, "style-src": [CSP.SELF, CSP.UNSAFE_INLINE]})(
    SpectacularSwaggerSplitView.as_view(url_name="api-schema")
)

api_urlpatterns: list[URLPattern | URLResolver] = [
    path("me", accounts_api.MeView.as_view(), name="api-me"),
    path("status", StatusView.as_view(), name="api-status"),
    path("nodes/enrollments", cluster_api.NodeEnrollmentView.as_view(), name="api-node-enrollments"),
    path("sim", sim_api.SimView.as_view(), name="api-sim"),
    path("sim/<id:pk>", sim_api.SimRunView.as_view(), name="api-sim-run"),
    path("agent/enroll", cluster_api.AgentEnrollView.as_view(), name="api-agent-enroll"),
    path("engines", cluster_api.EngineChoicesView.as_view(), name="api-engines"),
    path("fabrics", fabrics_api.FabricsView.as_view(), name="api-fabrics"),
    path("nvlink", fabrics_api.NVLinkView.as_view(), name="api-nvlink"),
    path("facility", facility_api.FacilityView.as_view(), name="api-facility"),
    path("facility/holds", facility_api.HoldsView.as_view(), name="api-facility-holds"),
    path("facility/release", facility_api.ReleaseView.as_view(), name="api-facility-release"),
    path("facility/budgets", facility_api.BudgetsView.as_view(), name="api-facility-budgets"),
    path("guardrails", guardrails_api.PoliciesView.as_view(), name="api-guardrails"),
    path("guardrails/<str:name>", guardrails_api.PolicyView.as_view(), name="api-guardrail"),
    path("fabric-tests", fabrics_api.FabricTestsView.as_view(), name="api-fabric-tests"),
    path("fabric-tests/<str:pk>", fabrics_api.FabricTestView.as_view(), name="api-fabric-test"),
    path("agent-requests", cluster_api.AgentRequestsView.as_view(), name="api-agent-requests"),
    path("agent-requests/<str:pk>/retry", cluster_api.AgentRequestRetryView.as_view(), name="api-agent-request-retry"),
    path("fabrics/<str:fabric>/topology", fabrics_api.FabricTopologyView.as_view(), name="api-fabric-topology"),
    path("mirror", mirror_api.MirrorView.as_view(), name="api-mirror"),
    path("mirror/search", mirror_api.MirrorSearchView.as_view(), name="api-mirror-search"),
    path("mirror/repos/<str:owner>/<str:name>", mirror_api.MirrorRepoView.as_view(), name="api-mirror-repo"),
    path("mirror/<str:pk>", mirror_api.MirrorVersionView.as_view(), name="api-mirror-version"),
    path("mirror/<str:pk>/manifest", mirror_api.MirrorManifestView.as_view(), name="api-mirror-manifest"),
    path("mirror/<str:pk>/estimate", mirror_api.MirrorEstimateView.as_view(), name="api-mirror-estimate"),
    path("engines/remove", cluster_api.EngineRemoveView.as_view(), name="api-engines-remove"),
    path("engines/refresh", cluster_api.EngineRefreshView.as_view(), name="api-engines-refresh"),
    path("engine-files/<str:name>", cluster_api.engine_file, name="api-engine-file"),
    path("mirror-files/<str:pk>/<path:path>", mirror_api.mirror_file, name="api-mirror-file"),
    path("usage", quotas_api.UsageView.as_view(), name="api-usage"),
    path("requests/<str:request_id>", quotas_api.RequestView.as_view(), name="api-request"),
    path("schema", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs", api_docs, name="api-docs"),
    path("", include(router.urls)),
]

# Under /api/ these answer JSON; elsewhere Django's own pages (llmgw.edge).
handler400 = "llmgw.edge.bad_request"
handler403 = "llmgw.edge.permission_denied"
handler404 = "llmgw.edge.page_not_found"
handler500 = "llmgw.edge.server_error"

urlpatterns = [
    path("", console.landing, name="landing"),
    path("favicon.ico", console.favicon, name="favicon"),
    path("login/", accounts_views.sign_in, name="login"),
    path("signup/", accounts_views.sign_up, name="signup"),
    path("signup/done/", accounts_views.sign_up_done, name="signup-done"),
    # Signing out also ends the provider's session for people who came through single sign-on.
    path("logout/", oidc.SsoLogoutView.as_view(), name="logout"),
    path("oidc/failed/", oidc.sign_in_failed, name="sso-failed"),
    path("oidc/", include("mozilla_django_oidc.urls")),
    path("_lang/<str:code>", console.set_language, name="set-language"),
    path("docs/", docs.docs_index, name="docs"),
    path("docs/<str:slug>", docs.docs_page, name="docs-page"),
    path("about", about.about, name="about"),
    path("account/", key_views.account, name="account"),
    path("account/keys/", key_views.api_keys, name="api-keys"),
    path("connect/<str:tool>.sh", key_views.connect_script, name="connect-script"),
    path("audit/", audit_views.audit, name="audit"),
    path("chat/", chat_views.chat, name="chat"),
    path("chat/session-key", chat_views.chat_session_key, name="chat-session-key"),
    path("chat/render", chat_views.chat_render, name="chat-render"),
    path("usage/", usage_views.usage, name="usage"),
    path("batches/", include("apps.batches.urls")),
    path("cluster/", cluster_views.cluster, name="cluster"),
    path("sim/", sim_views.sim, name="sim"),
    path("sim/runs", sim_views.sim_runs, name="sim-runs"),
    path("sim/runs/<id:pk>", sim_views.sim_run, name="sim-run"),
    path("sim/what-if", sim_views.sim_what_if, name="sim-what-if"),
    path("cluster/engines/set", cluster_views.engine_set, name="cluster-engine-set"),
    path("install/node.sh", cluster_views.install_script, name="install-script"),
    path("install/<str:name>", cluster_views.install_bundle, name="install-bundle"),
    path("cluster/engines/remove", cluster_views.engine_remove, name="cluster-engine-remove"),
    path("cluster/engine-build/<str:name>", cluster_views.engine_build, name="cluster-engine-build"),
    path("people/", people_views.people, name="people"),
    path("people/members/", people_views.people_members, name="people-members"),
    path("people/limits/", people_views.people_limits, name="people-limits"),
    path("people/usage/", people_views.people_usage, name="people-usage"),
    path("people/members/add", people_views.people_member_add, name="people-member-add"),
    path("people/members/<id:pk>/remove", people_views.people_member_remove, name="people-member-remove"),
    path("people/users/<id:pk>/suspend", people_views.people_user_suspend, name="people-user-suspend"),
    path("people/users/<id:pk>/reactivate", people_views.people_user_reactivate, name="people-user-reactivate"),
    path("people/teams/add", people_views.people_team_add, name="people-team-add"),
    path("people/projects/add", people_views.people_project_add, name="people-project-add"),
    path("people/organizations/add", people_views.people_organization_add, name="people-organization-add"),
    path("people/branches/rename", people_views.people_branch_rename, name="people-branch-rename"),
    path("people/branches/remove", people_views.people_branch_remove, name="people-branch-remove"),
    path("people/limits/rate", quotas_people.people_rate_limit, name="people-rate-limit"),
    path("people/limits/capacity", quotas_people.people_capacity_quota, name="people-capacity-quota"),
    path("people/limits/share", people_views.people_share, name="people-share"),
    path("org/", people_views.org, name="org"),
    path("org/limits/", people_views.org_limits, name="org-limits"),
    path("org/usage/", people_views.org_usage, name="org-usage"),
    path("mirror/", include("apps.mirror.urls")),
    path("nodes/", include("apps.cluster.urls")),
    path("fabrics/", include("apps.fabrics.urls")),
    path("facility/", include("apps.facility.urls")),
    path("guardrails/", guardrails_views.guardrails, name="guardrails"),
    path("guardrails/set", guardrails_views.set_policy, name="guardrails-set"),
    path("guardrails/remove", guardrails_views.remove_policy, name="guardrails-remove"),
    path("models/", include("apps.cluster.model_urls")),
    path("api/v1/", include(api_urlpatterns)),
    # The admin signs in through /login/, under the same bounds as everyone else.
    path("django-admin/login/", accounts_views.admin_sign_in),
    path("django-admin/", admin.site.urls),
    path("metrics", ops.metrics, name="metrics"),
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
]
