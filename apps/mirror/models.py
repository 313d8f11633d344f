"""What the mirror holds: versions of models fetched from the Hub, file by file."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _

from agent.safepath import inside

__all__ = ["MirrorFile", "MirrorVersion"]


class MirrorVersion(models.Model):
    """One thing fetched from one repository at one commit: a GGUF file, a split GGUF set, or a
    safetensors set with its index, config and tokenizer files."""

    class Kind(models.TextChoices):
        GGUF = "gguf", _("GGUF")
        SAFETENSORS = "safetensors", _("safetensors set")
        FILES = "files", _("files")

    repo = models.CharField(_("repository"), max_length=200)
    revision = models.CharField(_("revision asked for"), max_length=200, default="main")
    commit = models.CharField(_("commit"), max_length=64)
    name = models.CharField(_("name"), max_length=500)
    kind = models.CharField(_("kind"), max_length=16, choices=Kind.choices)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(_("added"), auto_now_add=True)

    class Meta:
        verbose_name = _("mirrored model version")
        verbose_name_plural = _("mirrored model versions")
        ordering = ["repo", "name", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["repo", "commit", "name"], name="mirror_version_unique_repo_commit_name")
        ]

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:8]} {self.name}"

    @property
    def folder(self) -> Path:
        """Where the version's files are, resolved under `MIRROR_DIR`; UnsafePath when the repository
        or commit would lead anywhere else."""
        return inside(Path(settings.MIRROR_DIR).absolute(), self.repo.replace("/", "--"), self.commit, what="version")


class MirrorFile(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued", _("queued")
        DOWNLOADING = "downloading", _("downloading")
        HELD = "held", _("held")
        FAILED = "failed", _("failed")

    version = models.ForeignKey(MirrorVersion, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(_("path in the repository"), max_length=1000)
    size = models.BigIntegerField(_("size (bytes)"), null=True, blank=True)
    # The Hub's LFS digest; blank for a small file, checked by its git blob id instead.
    sha256 = models.CharField(_("sha256"), max_length=64, blank=True)
    blob_id = models.CharField(_("git blob id"), max_length=64, blank=True)
    state = models.CharField(_("state"), max_length=16, choices=State.choices, default=State.QUEUED)
    bytes_done = models.BigIntegerField(_("bytes fetched"), default=0)
    rate = models.FloatField(_("bytes per second"), null=True, blank=True)
    error = models.TextField(_("error"), blank=True)
    etag = models.CharField(_("ETag"), max_length=200, blank=True)
    attempts = models.PositiveSmallIntegerField(_("attempts"), default=0)
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    # Renewed by the fetch as it reports; a downloading file whose fetch stopped reporting is resumed.
    progress_at = models.DateTimeField(_("last progress"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("mirrored file")
        verbose_name_plural = _("mirrored files")
        ordering = ["version", "path"]
        constraints = [models.UniqueConstraint(fields=["version", "path"], name="mirror_file_unique_version_path")]

    def __str__(self) -> str:
        return f"{self.version.repo}/{self.path}"

    @property
    def local_path(self) -> Path:
        """Where the file is, resolved under its version's folder; UnsafePath when its path (as the
        Hub named it) would lead anywhere else."""
        return inside(self.version.folder, self.path, what="file path")

    @property
    def part_path(self) -> Path:
        """Where the file is written until it is whole and verified."""
        local = self.local_path
        return local.with_name(local.name + ".part")

    @property
    def seconds_left(self) -> float | None:
        if self.state != self.State.DOWNLOADING or not self.rate or self.size is None:
            return None
        return max(self.size - self.bytes_done, 0) / self.rate
