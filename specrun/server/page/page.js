// specrun's chat page: streams replies from this server's own /v1/chat/completions and tints
// the text that came from accepted drafts, by source. Every request goes to this page's own
// origin (relative URLs; the server's Content-Security-Policy allows no other). The API key,
// when one is set, is kept in this browser's localStorage and sent only to this origin.
"use strict";

const $ = (id) => document.getElementById(id);
const messages = [];
let controller = null;

const keyInput = $("key");
keyInput.value = localStorage.getItem("specrun.key") || "";
keyInput.addEventListener("change", () => {
  localStorage.setItem("specrun.key", keyInput.value);
  loadModel();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyInput.value) h.Authorization = "Bearer " + keyInput.value;
  return h;
}

async function errorOf(response) {
  const body = await response.json().catch(() => ({}));
  return (body.error && body.error.message) || "HTTP " + response.status;
}

async function loadModel() {
  const el = $("model");
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await errorOf(r));
    const card = (await r.json()).data[0];
    el.textContent = card.id + (card.draft ? " + " + card.draft : "");
    el.classList.remove("error");
  } catch (e) {
    el.textContent = e.message;
    el.classList.add("error");
  }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  if (text) div.textContent = text;
  $("log").appendChild(div);
  return div;
}

// runs of [text, source] or [text, source, "branch"]: source "model" or "ngram" for text from
// accepted drafts, null for the target's own; "branch" for drafts from a token tree's branch
// other than the first (--tree), tinted apart
function addSpans(div, spans) {
  for (const [text, source, branch] of spans) {
    if (source) {
      const span = document.createElement("span");
      span.className = "d-" + source + (branch ? " d-branch" : "");
      span.textContent = text;
      div.appendChild(span);
    } else {
      div.appendChild(document.createTextNode(text));
    }
  }
  $("log").scrollTop = $("log").scrollHeight;
}

function showStats(s) {
  $("tps").textContent = s.tok_s.toFixed(1) + " tok/s";
  $("accept").textContent = "accept " + (s.drafted ? Math.round((100 * s.accepted) / s.drafted) : 0) + "%";
  const sources = Object.entries(s.by_source).sort((a, b) => b[1].rounds - a[1].rounds);
  const rounds = sources.reduce((n, [, v]) => n + v.rounds, 0);
  $("mix").textContent = rounds
    ? "drafts " + sources.map(([k, v]) => k + " " + Math.round((100 * v.rounds) / rounds) + "%").join(" · ")
    : "drafts –";
  const trees = s.tree_rounds || 0; // shown once a round verified a token tree
  $("branch").hidden = !trees;
  document.querySelector(".legend .d-branch").hidden = !trees;
  if (trees) $("branch").textContent = "branch won " + s.branch_wins + "/" + trees + " trees";
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  messages.push({ role: "user", content: text });
  bubble("user", text);
  const div = bubble("assistant");
  controller = new AbortController();
  setBusy(true);
  let reply = "";
  try {
    const body = { messages, stream: true, stream_options: { include_usage: true, include_drafts: true } };
    const max = parseInt($("max-tokens").value, 10);
    if (max > 0) body.max_tokens = max;
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorOf(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, at);
        buf = buf.slice(at + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const ext = chunk.specrun || {};
        const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
        if (delta.content) {
          reply += delta.content;
          addSpans(div, ext.spans || [[delta.content, null]]);
        }
        if (ext.stats) showStats(ext.stats);
        if (chunk.timings) div.dataset.finish = chunk.choices[0].finish_reason;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      const err = document.createElement("div");
      err.className = "error";
      err.textContent = e.message;
      div.appendChild(err);
    }
  } finally {
    if (reply) messages.push({ role: "assistant", content: reply });
    else messages.pop();
    div.dataset.done = "1";
    controller = null;
    setBusy(false);
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  messages.length = 0;
  $("log").replaceChildren();
});

loadModel();
