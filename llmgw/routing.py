"""Websocket routes."""

from __future__ import annotations

from django.urls import path

from apps.cluster.consumers import AgentConsumer

websocket_urlpatterns = [
    path("ws/agent/", AgentConsumer.as_asgi()),
]
