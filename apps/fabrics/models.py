"""What each node says of its InfiniBand and RoCE ports, and every change of master a port saw."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class NodeFabrics(models.Model):
    """The ports a node can carry traffic on, as its agent last said (it says so when they change).

    `ports`: one entry per port — device, port, the declared fabric name ("" on none), link layer,
    whether it is up, its port GUID, the master subnet manager it sees (`sm_guid`, InfiniBand), the
    IP network of its RoCE v2 address (`network`), rate and netdev. Unknown values are absent.
    """

    node = models.OneToOneField(
        "cluster.Node", on_delete=models.CASCADE, related_name="fabric_ports", verbose_name=_("node")
    )
    ports = models.JSONField(_("ports"), default=list, blank=True)
    declared = models.JSONField(_("declared fabrics"), default=list, blank=True)
    flaps = models.JSONField(_("flaps"), default=dict, blank=True)
    # netdev -> its IP addresses, as the agent read them (`ip -j addr`)
    interfaces = models.JSONField(_("interfaces"), default=dict, blank=True)
    changes = models.PositiveIntegerField(_("changes"), default=0)
    changed_at = models.DateTimeField(_("changed"), null=True, blank=True)

    class Meta:
        verbose_name = _("node fabrics")
        verbose_name_plural = _("node fabrics")

    def __str__(self) -> str:
        return f"{self.node_id}"


class MasterChange(models.Model):
    """A port reporting a master subnet manager other than the one it reported before."""

    node = models.ForeignKey("cluster.Node", on_delete=models.CASCADE, related_name="+", verbose_name=_("node"))
    port = models.CharField(_("port"), max_length=100)
    previous = models.CharField(_("previous master"), max_length=32, blank=True)
    master = models.CharField(_("master"), max_length=32, blank=True)
    at = models.DateTimeField(_("at"), auto_now_add=True, db_index=True)

    class Meta:
        verbose_name = _("change of master")
        verbose_name_plural = _("changes of master")
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.port}: {self.previous} -> {self.master}"


class FabricMap(models.Model):
    """One ibnetdiscover map of a physical fabric, parsed here (apps.fabrics.topology.to_dict)."""

    fabric = models.CharField(_("fabric"), max_length=100, db_index=True)
    node = models.ForeignKey(
        "cluster.Node", on_delete=models.SET_NULL, null=True, related_name="+", verbose_name=_("mapped from")
    )
    device = models.CharField(_("adapter"), max_length=64, blank=True)
    taken_at = models.DateTimeField(_("taken"), auto_now_add=True, db_index=True)
    data = models.JSONField(_("map"), default=dict)

    class Meta:
        verbose_name = _("fabric map")
        verbose_name_plural = _("fabric maps")
        ordering = ["-taken_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.fabric} @ {self.taken_at:%Y-%m-%d %H:%M}"


class FabricTest(models.Model):
    """`ctl fabric-test A B`: ib_write_bw between two nodes, adapter by adapter as NCCL pairs
    them, one rail at a time; each rail graded against its link's rate (`rails`)."""

    class State(models.TextChoices):
        RUNNING = "running", _("running")
        DONE = "done", _("done")
        FAILED = "failed", _("failed")

    client = models.ForeignKey("cluster.Node", on_delete=models.CASCADE, related_name="+", verbose_name=_("client"))
    server = models.ForeignKey("cluster.Node", on_delete=models.CASCADE, related_name="+", verbose_name=_("server"))
    fabric = models.CharField(_("fabric"), max_length=100)
    state = models.CharField(_("state"), max_length=16, choices=State.choices, default=State.RUNNING)
    duration_s = models.PositiveSmallIntegerField(_("seconds per rail"), default=5)
    rails = models.JSONField(_("rails"), default=list)
    error = models.TextField(_("error"), blank=True)
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("fabric test")
        verbose_name_plural = _("fabric tests")
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.client_id} -> {self.server_id}"
