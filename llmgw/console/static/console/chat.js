// The chat page: talks to /v1/chat/completions from the browser with a short-lived key.
//
// - The key comes from POST /chat/session-key and lives in this script's memory only; a reload
//   asks again. Nothing secret is written to storage.
// - Replies stream in (stream: true, stream_options.include_usage) and are shown as they come;
//   while one streams, Send is Stop, which aborts the request and keeps what arrived.
// - Under each reply: tokens (the engine's count), tokens a second, time to the first token and
//   in all, and the hardware that answered (the x-llmgw-hardware header).
// - The conversation, the system prompt, the temperature, the most tokens an answer may have
//   (1024 at first: a base model never stops by itself; empty for no limit) and the model are kept in
//   localStorage; after a reload the model's turns are rendered again by the server
//   (POST /chat/render), as they were when they came.
// - Math is typeset with KaTeX (loaded by this page only) once a reply is rendered by the server,
//   that is when it has finished streaming and after a reload; while it streams it is plain text.
// - Every text this script shows comes translated from the page's data-t-* attributes.
(function () {
  "use strict";

  const root = document.getElementById("chat");
  if (!root) {
    return;
  }
  const data = root.dataset;
  const STORE = "llmgw.chat.v1";
  const lang = document.documentElement.lang || undefined;
  const numbers = new Intl.NumberFormat(lang, { maximumFractionDigits: 1 });
  const seconds = new Intl.NumberFormat(lang, { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  const integers = new Intl.NumberFormat(lang, { maximumFractionDigits: 0 });

  const picker = document.getElementById("chat-model");
  const log = document.getElementById("chat-log");
  const form = document.getElementById("chat-form");
  const prompt = document.getElementById("chat-prompt");
  const send = document.getElementById("chat-send");
  const system = document.getElementById("chat-system");
  const temperature = document.getElementById("chat-temperature");
  const maxTokens = document.getElementById("chat-max-tokens");
  const status = document.getElementById("chat-status");
  const fresh = document.getElementById("chat-new");

  let key = null; // { secret, expiresAt (ms) }: memory only
  let controller = null; // the AbortController of the reply streaming now
  let state = load();

  // Text --------------------------------------------------------------------------------------

  function say(template, values) {
    return String(template || "").replace(/%\((\w+)\)s/g, function (whole, name) {
      return Object.prototype.hasOwnProperty.call(values || {}, name) ? String(values[name]) : whole;
    });
  }

  function inSeconds(ms) {
    if (typeof ms !== "number" || !isFinite(ms)) {
      return "-";
    }
    return say(data.tSeconds, { value: seconds.format(ms / 1000) });
  }

  function hardwareName(value) {
    if (!value) {
      return "-";
    }
    if (value.toLowerCase() === "cpu") {
      return data.tCpu;
    }
    if (value.toLowerCase() === "external") {
      return data.tExternal;
    }
    return value;
  }

  function showStatus(text) {
    status.textContent = text || "";
    status.classList.toggle("hidden", !text);
  }

  // Storage -----------------------------------------------------------------------------------

  function load() {
    let saved = null;
    try {
      saved = JSON.parse(window.localStorage.getItem(STORE) || "null");
    } catch (error) {
      saved = null;
    }
    const empty = { turns: [], system: "", temperature: "", maxTokens: maxTokens.value, model: "" };
    if (!saved || typeof saved !== "object" || !Array.isArray(saved.turns)) {
      return empty;
    }
    return {
      turns: saved.turns.filter(function (turn) {
        return turn && (turn.role === "user" || turn.role === "assistant") && typeof turn.content === "string";
      }),
      system: typeof saved.system === "string" ? saved.system : "",
      temperature: typeof saved.temperature === "string" ? saved.temperature : "",
      maxTokens: typeof saved.maxTokens === "string" ? saved.maxTokens : empty.maxTokens,
      model: typeof saved.model === "string" ? saved.model : "",
    };
  }

  // The field's most tokens for an answer as a whole number of at least 1; null when empty or not a number.
  function wholeTokens(text) {
    const value = Number(String(text).trim());
    if (String(text).trim() === "" || !isFinite(value)) {
      return null;
    }
    return Math.max(1, Math.floor(value));
  }

  function save() {
    state.system = system.value;
    state.temperature = temperature.value;
    state.maxTokens = maxTokens.value;
    state.model = picker.value || state.model;
    try {
      window.localStorage.setItem(STORE, JSON.stringify(state));
    } catch (error) {
      // Storage full or refused (private mode): the conversation still works, it just is not kept.
    }
  }

  // The page's key ----------------------------------------------------------------------------

  function keyProblem(reason) {
    const error = new Error(say(data.tNoKey, { reason: reason }));
    error.keyProblem = true;
    return error;
  }

  async function getKey(renew) {
    if (!renew && key && Date.now() < key.expiresAt - 60000) {
      return key.secret;
    }
    let response = null;
    try {
      response = await fetch(data.sessionKeyUrl, {
        method: "POST",
        credentials: "same-origin",
        headers: { "X-CSRFToken": data.csrf, "Accept": "application/json" },
      });
    } catch (error) {
      throw keyProblem(data.tNoAnswer);
    }
    if (response.redirected || !(response.headers.get("content-type") || "").includes("application/json")) {
      throw keyProblem(data.tSignedOut); // sent to the sign-in page: the session has ended
    }
    if (!response.ok) {
      throw keyProblem(response.status + " " + response.statusText);
    }
    const answer = await response.json();
    key = { secret: answer.key, expiresAt: Date.now() + 1000 * Number(answer.expires_in || 0) };
    return key.secret;
  }

  // Drawing -----------------------------------------------------------------------------------

  function turnElement(turn) {
    const article = document.createElement("article");
    article.dataset.role = turn.role;
    article.className = turn.role === "user"
      ? "chat-turn self-end max-w-full rounded-lg bg-indigo-50 px-3 py-2 sm:max-w-[85%]"
      : "chat-turn max-w-full rounded-lg border border-slate-200 bg-white px-3 py-2 sm:max-w-[85%]";
    const who = document.createElement("p");
    who.className = "mb-1 text-xs font-semibold text-slate-500";
    who.textContent = turn.role === "user" ? data.tYou : (turn.model || "");
    const body = document.createElement("div");
    body.className = turn.role === "user" ? "chat-text whitespace-pre-wrap break-words text-sm" : "chat-text chat-md break-words";
    body.textContent = turn.content;
    if (turn.role === "assistant") {
      body.classList.add("whitespace-pre-wrap");
    }
    article.append(who, body);
    const meta = document.createElement("p");
    meta.className = "chat-meta mt-1 text-xs text-slate-500";
    const note = document.createElement("p");
    note.className = "chat-note mt-1 hidden text-xs text-amber-800";
    article.append(meta, note);
    paintMeta(article, turn);
    return article;
  }

  function paintMeta(article, turn) {
    const meta = article.querySelector(".chat-meta");
    const note = article.querySelector(".chat-note");
    if (turn.role === "assistant" && turn.meta) {
      const m = turn.meta;
      const parts = [say(data.tUsage, {
        tokens: typeof m.tokens === "number" ? integers.format(m.tokens) : "-",
        rate: typeof m.rate === "number" && isFinite(m.rate) ? numbers.format(m.rate) : "-",
        first: inSeconds(m.first),
        total: inSeconds(m.total),
      })];
      if (m.hardware) {
        parts.push(say(data.tServed, { hardware: hardwareName(m.hardware) }));
      }
      meta.textContent = parts.join(" · ");
      meta.dataset.hardware = m.hardware || "";
      meta.title = m.replica ? m.replica + (m.request ? " · " + m.request : "") : (m.request || "");
    } else {
      meta.textContent = "";
    }
    note.textContent = turn.note || "";
    note.classList.toggle("hidden", !turn.note);
    note.classList.toggle("text-red-700", turn.failed === true);
    note.classList.toggle("text-amber-800", turn.failed !== true);
  }

  // Math --------------------------------------------------------------------------------------

  // The server marks each formula outside code as <span class="math">, holding its source with
  // its delimiters ($…$, $$…$$, \(…\), \[…\]); code blocks and inline code never hold one.
  const DELIMITERS = [["$$", "$$", true], ["\\[", "\\]", true], ["\\(", "\\)", false], ["$", "$", false]];

  function formula(source) {
    for (const [open, close, display] of DELIMITERS) {
      if (source.length > open.length + close.length && source.startsWith(open) && source.endsWith(close)) {
        return { tex: source.slice(open.length, source.length - close.length), display: display };
      }
    }
    return null;
  }

  function styleThroughCssom(tree) {
    // KaTeX gives a few nodes (some SVGs, one MathML element) a style attribute, which it sets
    // with setAttribute; the page's CSP (style-src 'self') refuses those. The same declarations
    // set through CSSOM (element.style) are not governed by the CSP, so they are moved there.
    const pending = [tree];
    while (pending.length) {
      const node = pending.pop();
      if (node.attributes && typeof node.attributes.style === "string") {
        const css = node.attributes.style;
        const build = node.toNode;
        delete node.attributes.style;
        node.toNode = function () {
          const element = build.call(this);
          if (element.style) {
            element.style.cssText = css;
          }
          return element;
        };
      }
      (node.children || []).forEach(function (child) { pending.push(child); });
    }
    return tree;
  }

  function typeset(body) {
    const katex = window.katex;
    if (!katex || typeof katex.__renderToDomTree !== "function") {
      return; // KaTeX did not load: the formulas stay as written
    }
    body.querySelectorAll(".math").forEach(function (span) {
      if (span.closest("pre, code")) {
        return;
      }
      const math = formula(span.textContent);
      if (!math) {
        return;
      }
      try {
        // KaTeX's tree before it becomes DOM (katex.render would build the DOM at once), so that
        // its style attributes can be moved first; the version is pinned (console/katex/README.txt).
        // throwOnError: a malformed formula throws here, before anything changes, and stays as
        // its source text (KaTeX's own error display would set a style attribute).
        const tree = katex.__renderToDomTree(math.tex, {
          displayMode: math.display, throwOnError: true, strict: "ignore", trust: false, maxSize: 50, maxExpand: 1000,
        });
        span.replaceChildren(styleThroughCssom(tree).toNode());
        span.classList.add("math-typeset");
      } catch (error) {
        span.classList.add("math-error");
        span.title = data.tMathError;
      }
    });
  }

  function setHtml(article, html) {
    const body = article.querySelector(".chat-text");
    body.classList.remove("whitespace-pre-wrap");
    // Rendered and sanitised by the server (/chat/render): raw HTML in a reply arrives escaped.
    body.innerHTML = html;
    typeset(body);
  }

  async function renderTurns(pairs) {
    // pairs: [[article, text], ...] — the model's turns to render on the server, in one request.
    if (!pairs.length) {
      return;
    }
    try {
      const response = await fetch(data.renderUrl, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-CSRFToken": data.csrf, "Accept": "application/json" },
        body: JSON.stringify({ texts: pairs.map(function (pair) { return pair[1]; }) }),
      });
      if (!response.ok) {
        return; // the plain text stays, which is readable
      }
      const answer = await response.json();
      (answer.html || []).forEach(function (html, index) {
        if (pairs[index] && typeof html === "string") {
          setHtml(pairs[index][0], html);
        }
      });
    } catch (error) {
      // Offline or signed out: the plain text stays.
    }
  }

  function drawAll() {
    log.replaceChildren();
    const pending = [];
    state.turns.forEach(function (turn) {
      const article = turnElement(turn);
      log.append(article);
      if (turn.role === "assistant" && turn.content) {
        pending.push([article, turn.content]);
      }
    });
    renderTurns(pending);
  }

  function streaming(on) {
    send.textContent = on ? data.tStop : data.tSend;
    send.dataset.state = on ? "stop" : "send";
    send.classList.toggle("btn-danger", on);
    send.classList.toggle("btn-primary", !on);
    send.disabled = !on && !picker.value;
    picker.disabled = on || picker.options.length === 0;
    fresh.disabled = on;
  }

  // Talking to the gateway ----------------------------------------------------------------------

  function conversation() {
    const messages = [];
    if (system.value.trim()) {
      messages.push({ role: "system", content: system.value });
    }
    const turns = state.turns;
    turns.forEach(function (turn, index) {
      const next = turns[index + 1];
      // A question that got no answer (refused, or stopped before a word) is left out with its
      // empty reply, so the roles still alternate.
      const unanswered = turn.role === "user" && next && next.role === "assistant" && !next.content;
      if (turn.content && !unanswered) {
        messages.push({ role: turn.role, content: turn.content });
      }
    });
    return messages;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error) {
        return typeof body.error === "string" ? body.error : (body.error.message || JSON.stringify(body.error));
      }
    } catch (error) {
      // not JSON
    }
    return response.status + " " + response.statusText;
  }

  function sleep(ms) {
    return new Promise(function (resolve) { window.setTimeout(resolve, ms); });
  }

  async function post(body, signal, reply) {
    let secret = await getKey(false);
    const request = function () {
      reply.started = performance.now(); // timed from the request that is answered
      return fetch(data.apiUrl, {
        method: "POST",
        credentials: "omit",
        headers: { "Content-Type": "application/json", "Authorization": "Bearer " + secret },
        body: JSON.stringify(body),
        signal: signal,
      });
    };
    let response = await request();
    if (response.status === 401) {
      // A new key reaches the gateway's tables within a second or two; an old one may have ended.
      await sleep(1500);
      secret = await getKey(true);
      response = await request();
    }
    return response;
  }

  function handleEvent(payload, reply) {
    if (payload.error) {
      const error = payload.error;
      reply.error = typeof error === "string" ? error : (error.message || JSON.stringify(error));
      return;
    }
    if (payload.usage) {
      reply.usage = payload.usage;
    }
    (payload.choices || []).forEach(function (choice) {
      const piece = choice && choice.delta && typeof choice.delta.content === "string" ? choice.delta.content : "";
      if (piece) {
        if (reply.first === null) {
          reply.first = performance.now() - reply.started;
        }
        reply.text += piece;
      }
      if (choice && choice.finish_reason) {
        reply.finished = true;
        reply.reason = choice.finish_reason;
        if (choice.finish_reason === "content_filter") {
          reply.guard = payload.llmgw_guardrail || { policy: "-", rule: "-" };
        }
      }
    });
  }

  async function ask(text) {
    const model = picker.value;
    if (!model) {
      showStatus(data.tNoModel);
      return;
    }
    showStatus("");
    state.turns.push({ role: "user", content: text });
    const user = turnElement(state.turns[state.turns.length - 1]);
    log.append(user);
    const body = { model: model, messages: conversation(), stream: true, stream_options: { include_usage: true } };
    const chosen = temperature.value.trim();
    if (chosen !== "" && isFinite(Number(chosen))) {
      body.temperature = Math.min(2, Math.max(0, Number(chosen)));
    }
    const limit = wholeTokens(maxTokens.value);
    if (limit !== null) {
      body.max_tokens = limit;
    }

    const turn = { role: "assistant", content: "", model: model };
    state.turns.push(turn);
    const article = turnElement(turn);
    log.append(article);
    const shown = article.querySelector(".chat-text");
    save();

    controller = new AbortController();
    streaming(true);
    const reply = { text: "", first: null, usage: null, error: "", finished: false, reason: "", started: performance.now() };
    let response = null;
    let stopped = false;
    try {
      response = await post(body, controller.signal, reply);
      turn.meta = { hardware: response.headers.get("x-llmgw-hardware") || "",
                    replica: response.headers.get("x-llmgw-replica") || "",
                    request: response.headers.get("x-llmgw-request-id") || "" };
      if (!response.ok) {
        turn.failed = true;
        turn.note = say(data.tRefused, { reason: await errorMessage(response) });
      } else {
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        let done = false;
        while (!done) {
          const chunk = await reader.read();
          if (chunk.done) {
            break;
          }
          buffer += decoder.decode(chunk.value, { stream: true }).replace(/\r\n/g, "\n");
          let end = buffer.indexOf("\n\n");
          while (end !== -1) {
            const event = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            event.split("\n").forEach(function (line) {
              if (!line.startsWith("data:")) {
                return;
              }
              const value = line.slice(5).trim();
              if (value === "[DONE]") {
                done = true;
                return;
              }
              try {
                handleEvent(JSON.parse(value), reply);
              } catch (error) {
                // a line that is not JSON: skipped
              }
            });
            end = buffer.indexOf("\n\n");
          }
          shown.textContent = reply.text;
          turn.content = reply.text;
        }
        if (reply.error) {
          turn.failed = true;
          turn.note = say(data.tBroke, { reason: reply.error });
        } else if (reply.guard) {
          turn.failed = true;
          turn.note = say(data.tGuardStopped, { policy: reply.guard.policy, rule: reply.guard.rule });
        } else if (!done && !reply.finished) {
          turn.failed = true;
          turn.note = say(data.tBroke, { reason: data.tEndedEarly });
        } else if (reply.reason === "length" && limit !== null && reply.usage
                   && reply.usage.completion_tokens === limit) {
          // Cut at this page's limit (not at the engine's context, which "length" also means).
          turn.note = say(data.tAtLimit, { tokens: integers.format(limit) });
        }
      }
    } catch (error) {
      if (error && error.name === "AbortError") {
        stopped = true;
        turn.note = data.tStopped;
      } else if (error && error.keyProblem) {
        turn.failed = true;
        turn.note = error.message;
      } else if (!response) {
        turn.failed = true;
        turn.note = say(data.tBroke, { reason: data.tNoAnswer });
      } else {
        turn.failed = true;
        turn.note = say(data.tBroke, { reason: (error && error.message) || String(error) });
      }
    } finally {
      controller = null;
    }
    const total = performance.now() - reply.started;
    turn.content = reply.text;
    if (response && response.ok) {
      const tokens = reply.usage && typeof reply.usage.completion_tokens === "number"
        ? reply.usage.completion_tokens : null;
      const generating = reply.first !== null ? (total - reply.first) / 1000 : null;
      turn.meta = Object.assign(turn.meta || {}, {
        tokens: tokens,
        rate: tokens !== null && generating && generating > 0 ? tokens / generating : null,
        first: reply.first,
        total: total,
      });
    } else if (turn.meta && !stopped) {
      turn.meta = null; // a refusal has no timings worth showing
    }
    if (stopped && !turn.meta) {
      turn.meta = { tokens: null, rate: null, first: reply.first, total: total, hardware: "" };
    }
    paintMeta(article, turn);
    streaming(false);
    save();
    if (turn.content) {
      renderTurns([[article, turn.content]]);
    }
  }

  // Wiring ------------------------------------------------------------------------------------

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    if (controller) {
      controller.abort();
      return;
    }
    const text = prompt.value;
    if (!text.trim()) {
      return;
    }
    prompt.value = "";
    ask(text);
  });

  prompt.addEventListener("keydown", function (event) {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  fresh.addEventListener("click", function () {
    if (controller) {
      return;
    }
    state.turns = [];
    save();
    drawAll();
    showStatus("");
    prompt.focus();
  });

  [system, temperature, maxTokens].forEach(function (field) {
    field.addEventListener("change", save);
    field.addEventListener("input", save);
  });
  temperature.addEventListener("change", function () {
    // The gateway holds it to 0-2 whatever is sent; the field says so too.
    const value = temperature.value.trim();
    if (value !== "" && isFinite(Number(value))) {
      temperature.value = String(Math.min(2, Math.max(0, Number(value))));
      save();
    }
  });
  maxTokens.addEventListener("change", function () {
    // A whole number of at least 1, or empty (no limit).
    const value = wholeTokens(maxTokens.value);
    maxTokens.value = value === null ? "" : String(value);
    save();
  });
  picker.addEventListener("change", function () {
    save();
    streaming(false);
  });

  system.value = state.system;
  temperature.value = state.temperature;
  maxTokens.value = state.maxTokens;
  if (state.model && Array.from(picker.options).some(function (option) { return option.value === state.model; })) {
    picker.value = state.model;
  }
  drawAll();
  streaming(false);
  // Ask for the key now, so the first question does not wait for it; a failure is said when asking.
  if (picker.options.length) {
    getKey(false).catch(function (error) { showStatus(error.message); });
  }
})();
