"""The gateway's tables: the version of what it holds in memory, and the Responses API answers it keeps."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["StoredResponse", "TableVersion"]


class TableVersion(models.Model):
    """One row. Every gateway process polls it (one cheap query a second) and reloads its key
    and routing tables when it moved, whichever process made the change."""

    version = models.PositiveBigIntegerField(_("version"), default=0)

    class Meta:
        verbose_name = _("gateway table version")
        verbose_name_plural = _("gateway table versions")

    def __str__(self) -> str:
        return str(self.version)


class StoredResponse(models.Model):
    """A Responses API answer kept (the API's `store`, on unless a request says false or
    LLMGW_RESPONSES_STORE is off) until `expires_at`, for its organisation only (a key with no
    project: for its user only): fetched, listed, deleted and continued with previous_response_id.

    A continued conversation is a chain: `previous` names the response it continued, `thread` the
    chain's first response and `depth` how many come before it, so a chain is read in one query.
    `input_items` is what the request itself sent (its items, given ids), `response` the Response
    object as answered; `size_bytes` their JSON size, which bounds a chain's replay."""

    id = models.CharField(_("id"), primary_key=True, max_length=64)
    organization = models.ForeignKey(
        "accounts.Organization",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("organisation"),
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", verbose_name=_("user")
    )
    key_id = models.PositiveBigIntegerField(_("API key id"))
    model = models.CharField(_("model"), max_length=200)
    status = models.CharField(_("status"), max_length=20)
    previous = models.CharField(_("previous response"), max_length=64, null=True, blank=True)
    thread = models.CharField(_("first response of its conversation"), max_length=64)
    depth = models.PositiveIntegerField(_("responses before it"), default=0)
    input_items = models.JSONField(_("input items"), default=list)
    response = models.JSONField(_("response"), default=dict)
    size_bytes = models.PositiveBigIntegerField(_("size in bytes"), default=0)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    expires_at = models.DateTimeField(_("expires at"), db_index=True)

    class Meta:
        verbose_name = _("stored response")
        verbose_name_plural = _("stored responses")
        indexes = [models.Index(fields=["thread", "depth"], name="gateway_storedresp_thread")]

    def __str__(self) -> str:
        return self.id
