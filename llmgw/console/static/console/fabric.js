// The fabric drawing: switches in their tiers (core, spine, leaf), the adapters fanned out under
// their leaves, cables coloured by rate and bundled between switches, degraded ones dashed red;
// the cluster's own adapters live: a down port is ringed red, and dots run along each cable as
// fast as its adapter sends and receives (from the counters between two refreshes). Zoom and
// pan, hover fades what a switch or adapter does not touch, a click opens its detail, colour by
// rail, find a node. Drawn on a canvas so that a fabric of 200 switches and 1,300 adapters stays
// smooth; d3 gives the zoom, the quadtree for hit tests and the colour scales.
(function () {
  "use strict";
  const canvas = document.getElementById("fabric-canvas");
  if (!canvas || !window.d3) return;
  const d3 = window.d3;
  const labelsNode = document.getElementById("fabric-labels");
  const L = labelsNode ? JSON.parse(labelsNode.textContent) : {};
  const panel = document.getElementById("fabric-panel");
  const legend = document.getElementById("fabric-legend");
  const byRail = document.getElementById("fabric-by-rail");
  const find = document.getElementById("fabric-find");
  const ctx = canvas.getContext("2d");
  const TIERS = { core: 60, spine: 200, leaf: 340 };
  const ADAPTER_Y = 420;
  let model = null;
  let transform = d3.zoomIdentity;
  let hovered = null;
  let selected = null;
  let found = new Set();
  let previous = {};
  let traffic = {};
  let quadtree = null;
  let animating = false;

  function size() {
    const ratio = window.devicePixelRatio || 1;
    const rect = canvas.getBoundingClientRect();
    canvas.width = Math.max(1, Math.round(rect.width * ratio));
    canvas.height = Math.max(1, Math.round(rect.height * ratio));
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return rect;
  }

  function build(view) {
    const map = view.map;
    const width = Math.max(canvas.getBoundingClientRect().width, 800);
    const nodes = new Map();
    const railOf = {};
    for (const adapter of map.adapters) {
      for (const port of adapter.ports) if (port.leaf && port.rail !== null) railOf[port.leaf] = port.rail;
    }
    const switches = map.switches.map((s) => ({ ...s, kind: "switch", links: [] }));
    const leaves = switches.filter((s) => s.tier === "leaf");
    leaves.sort((a, b) => (railOf[a.guid] ?? 99) - (railOf[b.guid] ?? 99) || a.desc.localeCompare(b.desc));
    const fanned = new Map();
    for (const adapter of map.adapters) {
      if (adapter.kind !== "ca") continue;
      for (const port of adapter.ports) {
        if (!port.leaf) continue;
        if (!fanned.has(port.leaf)) fanned.set(port.leaf, []);
        fanned.get(port.leaf).push({ adapter, port });
      }
    }
    const step = Math.max(width / Math.max(leaves.length, 1), 6);
    leaves.forEach((leaf, i) => {
      leaf.x = step * (i + 0.5);
      leaf.y = TIERS.leaf;
      nodes.set(leaf.guid, leaf);
    });
    for (const s of switches) if (!nodes.has(s.guid)) nodes.set(s.guid, s);
    const neighbours = new Map();
    const note = (a, b) => {
      if (!neighbours.has(a)) neighbours.set(a, new Set());
      neighbours.get(a).add(b);
    };
    for (const link of map.links) {
      note(link.a, link.b);
      note(link.b, link.a);
    }
    // Spines sit over the leaves they reach, cores over their spines (barycentres), then spread.
    for (const tier of ["spine", "core"]) {
      const row = switches.filter((s) => (tier === "core" ? s.tier === "core" || s.tier === null : s.tier === tier));
      for (const s of row) {
        const xs = [...(neighbours.get(s.guid) || [])].map((g) => nodes.get(g)).filter((n) => n && n.x !== undefined);
        s.x = xs.length ? d3.mean(xs, (n) => n.x) : width / 2;
      }
      row.sort((a, b) => a.x - b.x);
      const gap = width / Math.max(row.length, 1);
      row.forEach((s, i) => {
        s.x = gap * (i + 0.5);
        s.y = TIERS[tier];
      });
    }
    const adapters = [];
    for (const [leafGuid, ports] of fanned) {
      const leaf = nodes.get(leafGuid);
      if (!leaf) continue;
      const spread = Math.min(step * 0.9, ports.length * 8);
      ports.forEach(({ adapter, port }, i) => {
        const offset = ports.length > 1 ? (i / (ports.length - 1) - 0.5) * spread : 0;
        const item = {
          kind: "adapter",
          guid: port.port_guid || adapter.guid,
          adapter,
          port,
          leaf: leafGuid,
          x: leaf.x + offset,
          y: ADAPTER_Y + (i % 4) * 12,
          links: [],
        };
        adapters.push(item);
        nodes.set(item.guid, item);
      });
    }
    const bundles = map.bundles.filter((b) => nodes.has(b.a) && nodes.has(b.b));
    for (const b of bundles) {
      nodes.get(b.a).links.push(b.b);
      nodes.get(b.b).links.push(b.a);
    }
    for (const a of adapters) {
      a.links.push(a.leaf);
      nodes.get(a.leaf).links.push(a.guid);
    }
    const rates = [...new Set(map.links.map((l) => l.rate_gbps).filter((r) => r))].sort((x, y) => x - y);
    const colour = d3.scaleOrdinal().domain(rates).range(["#94a3b8", "#0ea5e9", "#6366f1", "#10b981", "#f59e0b", "#a855f7"]);
    const rails = d3.scaleOrdinal(d3.schemeTableau10);
    const rateOf = new Map();
    for (const link of map.links) {
      const key = [link.a, link.b].sort().join("|");
      if (!rateOf.has(key) || link.degraded) rateOf.set(key, link);
    }
    const items = [...switches, ...adapters];
    quadtree = d3.quadtree().x((n) => n.x).y((n) => n.y).addAll(items);
    model = { view, switches, adapters, bundles, nodes, colour, rails, rateOf, rates };
    drawLegend();
  }

  function drawLegend() {
    if (!legend || !model) return;
    legend.replaceChildren();
    for (const rate of model.rates) {
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      for (const [name, value] of Object.entries({ display: "inline-block", width: "14px", height: "3px", "margin-right": "4px", "vertical-align": "middle", background: model.colour(rate) })) swatch.style.setProperty(name, value);
      item.append(swatch, `${rate} ${L.gbps || "Gb/s"}`);
      legend.append(item);
    }
    const bad = document.createElement("span");
    bad.className = "text-red-700";
    bad.textContent = `- - ${L.degraded || "degraded"}`;
    legend.append(bad);
  }

  function touches(node) {
    if (!node) return null;
    const set = new Set([node.guid, ...node.links]);
    if (node.kind === "adapter") for (const g of model.nodes.get(node.leaf)?.links || []) if (model.nodes.get(g)?.kind === "switch") set.add(g);
    return set;
  }

  function draw() {
    if (!model) return;
    const rect = size();
    ctx.save();
    ctx.clearRect(0, 0, rect.width, rect.height);
    ctx.translate(transform.x, transform.y);
    ctx.scale(transform.k, transform.k);
    const focus = touches(hovered || selected);
    const faded = (a, b) => focus && !(focus.has(a) && focus.has(b));
    const live = model.view.live || {};
    for (const b of model.bundles) {
      const a = model.nodes.get(b.a);
      const z = model.nodes.get(b.b);
      const link = model.rateOf.get([b.a, b.b].sort().join("|"));
      ctx.globalAlpha = faded(b.a, b.b) ? 0.06 : 0.55;
      ctx.strokeStyle = b.degraded ? "#dc2626" : model.colour(link ? link.rate_gbps : 0);
      ctx.lineWidth = Math.min(1 + b.count * 0.5, 6) / Math.sqrt(transform.k);
      ctx.setLineDash(b.degraded ? [6, 4] : []);
      ctx.beginPath();
      ctx.moveTo(a.x, a.y);
      ctx.lineTo(z.x, z.y);
      ctx.stroke();
    }
    for (const a of model.adapters) {
      const leaf = model.nodes.get(a.leaf);
      ctx.globalAlpha = faded(a.guid, a.leaf) ? 0.06 : 0.7;
      ctx.strokeStyle = a.port.degraded ? "#dc2626" : model.colour(a.port.rate_gbps);
      ctx.lineWidth = 1 / Math.sqrt(transform.k);
      ctx.setLineDash(a.port.degraded ? [4, 3] : []);
      ctx.beginPath();
      ctx.moveTo(leaf.x, leaf.y);
      ctx.lineTo(a.x, a.y);
      ctx.stroke();
    }
    ctx.setLineDash([]);
    const now = performance.now();
    for (const a of model.adapters) {
      const gbps = traffic[a.guid];
      if (!gbps) continue;
      const leaf = model.nodes.get(a.leaf);
      const t = ((now / 1000) * Math.min(0.2 + gbps / 50, 3)) % 1;
      ctx.globalAlpha = faded(a.guid, a.leaf) ? 0.1 : 0.9;
      ctx.fillStyle = "#0f766e";
      ctx.beginPath();
      ctx.arc(leaf.x + (a.x - leaf.x) * t, leaf.y + (a.y - leaf.y) * t, 2.2 / Math.sqrt(transform.k), 0, 2 * Math.PI);
      ctx.fill();
    }
    for (const s of model.switches) {
      ctx.globalAlpha = focus && !focus.has(s.guid) ? 0.15 : 1;
      ctx.fillStyle = byRail && byRail.checked && s.tier === "leaf" ? railColour(s) : s.tier === "core" ? "#1e293b" : s.tier === "spine" ? "#334155" : "#475569";
      const w = 10;
      ctx.fillRect(s.x - w / 2, s.y - 5, w, 10);
    }
    for (const a of model.adapters) {
      const state = live[a.guid];
      ctx.globalAlpha = focus && !focus.has(a.guid) ? 0.15 : 1;
      ctx.fillStyle = byRail && byRail.checked ? model.rails(a.port.rail ?? -1) : state ? "#0f766e" : "#94a3b8";
      ctx.beginPath();
      ctx.arc(a.x, a.y, 3, 0, 2 * Math.PI);
      ctx.fill();
      if ((state && state.up === false) || found.has(a.guid) || selected === a) {
        ctx.strokeStyle = state && state.up === false ? "#dc2626" : "#f59e0b";
        ctx.lineWidth = 2 / Math.sqrt(transform.k);
        ctx.beginPath();
        ctx.arc(a.x, a.y, 6, 0, 2 * Math.PI);
        ctx.stroke();
      }
    }
    ctx.restore();
    ctx.globalAlpha = 1;
  }

  function railColour(leaf) {
    for (const g of leaf.links) {
      const n = model.nodes.get(g);
      if (n && n.kind === "adapter" && n.port.rail !== null) return model.rails(n.port.rail);
    }
    return "#475569";
  }

  function loop() {
    draw();
    if (Object.keys(traffic).length) {
      animating = true;
      requestAnimationFrame(loop);
    } else {
      animating = false;
    }
  }

  function pick(event) {
    if (!quadtree) return null;
    const [px, py] = d3.pointer(event, canvas);
    const [x, y] = transform.invert([px, py]);
    const hit = quadtree.find(x, y, 10 / transform.k);
    return hit || null;
  }

  function row(name, value) {
    const dt = document.createElement("dt");
    dt.className = "font-semibold text-slate-600";
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.className = "mb-1";
    dd.textContent = value === null || value === undefined || value === "" ? "-" : String(value);
    return [dt, dd];
  }

  function show(node) {
    if (!panel) return;
    panel.replaceChildren();
    if (!node) {
      panel.classList.add("hidden");
      return;
    }
    const title = document.createElement("h3");
    title.className = "mb-2 font-semibold";
    const list = document.createElement("dl");
    if (node.kind === "switch") {
      title.textContent = `${L[node.tier ?? "unknown"] || L.switch || "switch"}: ${node.desc}`;
      list.append(...row("GUID", node.guid), ...row(L.lid || "LID", node.lid), ...row(L.ports || "ports", node.nports));
      list.append(...row(L.cables || "cables", node.links.length));
    } else {
      const state = (model.view.live || {})[node.guid];
      title.textContent = `${L.adapter || "adapter"}: ${node.adapter.desc}`;
      list.append(...row(L.host || "host", node.adapter.host), ...row("GUID", node.guid));
      list.append(...row(L.rail || "rail", node.port.rail), ...row(L.leaf || "leaf", model.nodes.get(node.leaf)?.desc));
      list.append(...row(L.rate || "rate", `${node.port.rate_gbps} ${L.gbps || "Gb/s"}`));
      if (node.port.degraded) list.append(...row(L.degraded || "degraded", `${L.expected || "expected"} ${node.port.expected_gbps || ""}`));
      if (state) {
        list.append(...row(L.node || "node", `${state.node} ${state.port}`), ...row("", `${state.state} / ${state.phys_state}`));
        if (traffic[node.guid] !== undefined) list.append(...row(L.traffic || "traffic", `${traffic[node.guid].toFixed(2)} ${L.gbps || "Gb/s"}`));
      }
    }
    panel.append(title, list);
    panel.classList.remove("hidden");
  }

  function measure(view) {
    const next = {};
    const rates = {};
    for (const [guid, state] of Object.entries(view.live || {})) {
      const bytes = (state.xmit_bytes || 0) + (state.rcv_bytes || 0);
      next[guid] = { bytes, at: state.taken_at };
      const before = previous[guid];
      if (before && state.taken_at && before.at && state.taken_at > before.at && bytes >= before.bytes) {
        rates[guid] = ((bytes - before.bytes) * 8) / 1e9 / (state.taken_at - before.at);
      }
    }
    previous = next;
    traffic = Object.fromEntries(Object.entries(rates).filter(([, v]) => v > 0));
  }

  async function refresh(first) {
    try {
      const response = await fetch(canvas.dataset.url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (!response.ok) throw new Error(String(response.status));
      const view = await response.json();
      if (!view.map) return;
      measure(view);
      if (first || !model || model.view.taken_at !== view.taken_at) build(view);
      else model.view = view;
      canvas.dataset.drawn = String(model.switches.length + model.adapters.length);
      if (!animating) loop();
    } catch (error) {
      canvas.dataset.error = String(error);
      if (panel && first) {
        panel.textContent = L.failed || "The map could not be read.";
        panel.classList.remove("hidden");
      }
    }
  }

  const zoom = d3
    .zoom()
    .scaleExtent([0.2, 40])
    .on("zoom", (event) => {
      transform = event.transform;
      if (!animating) draw();
    });
  d3.select(canvas).call(zoom);
  canvas.addEventListener("mousemove", (event) => {
    const hit = pick(event);
    if (hit !== hovered) {
      hovered = hit;
      canvas.style.cursor = hit ? "pointer" : "grab";
      if (!animating) draw();
    }
  });
  canvas.addEventListener("mouseleave", () => {
    hovered = null;
    if (!animating) draw();
  });
  canvas.addEventListener("click", (event) => {
    selected = pick(event);
    show(selected);
    if (!animating) draw();
  });
  if (byRail) byRail.addEventListener("change", () => draw());
  if (find) {
    find.addEventListener("keydown", (event) => {
      if (event.key !== "Enter" || !model) return;
      event.preventDefault();
      const text = find.value.trim().toLowerCase();
      const live = model.view.live || {};
      const hits = model.adapters.filter(
        (a) =>
          text &&
          ((a.adapter.host || "").toLowerCase().includes(text) ||
            (a.adapter.desc || "").toLowerCase().includes(text) ||
            ((live[a.guid] || {}).node || "").toLowerCase().includes(text)),
      );
      found = new Set(hits.map((a) => a.guid));
      canvas.dataset.found = String(hits.length);
      if (!hits.length) {
        show(null);
        if (panel) {
          panel.textContent = L.not_found || "not found";
          panel.classList.remove("hidden");
        }
      } else {
        const rect = canvas.getBoundingClientRect();
        const [x0, x1] = d3.extent(hits, (a) => a.x);
        const [y0, y1] = d3.extent(hits, (a) => a.y);
        const k = Math.min(8, 0.8 * Math.min(rect.width / Math.max(x1 - x0, 40), rect.height / Math.max(y1 - y0, 40)));
        const t = d3.zoomIdentity.translate(rect.width / 2, rect.height / 2).scale(k).translate(-(x0 + x1) / 2, -(y0 + y1) / 2);
        d3.select(canvas).call(zoom.transform, t);
        selected = hits[0];
        show(selected);
      }
      draw();
    });
  }
  window.addEventListener("resize", () => draw());
  refresh(true);
  setInterval(() => refresh(false), Number(canvas.dataset.refresh || 15000));
})();
