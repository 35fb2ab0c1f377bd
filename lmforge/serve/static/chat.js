// The chat page: a conversation sent to /v1/chat/completions with stream: true, read as
// server-sent events from fetch's ReadableStream; Stop aborts the request (AbortController),
// which cancels the generation on the server. No libraries, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} turns of this conversation
let modelName = null;
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("conversation").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    modelName = body.data[0].id;
    $("model").textContent = modelName + " · context " + body.data[0].max_model_len + " tokens";
  } catch (err) {
    $("model").textContent = "no model: " + err.message;
  }
}

// Each complete "data: ..." event of the SSE text, and what is left over for the next read.
function splitEvents(buffer) {
  const events = [];
  const parts = buffer.split(/\r\n\r\n|\n\n|\r\r/);
  const rest = parts.pop();
  for (const part of parts) {
    const data = part.split(/\r\n|\n|\r/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
    if (data.length) events.push(data.join("\n"));
  }
  return [events, rest];
}

async function send(text) {
  if (!modelName) await loadModel();
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant streaming", "");
  const system = $("system").value.trim();
  const body = {
    model: modelName,
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top_p").value),
    max_tokens: parseInt($("max_tokens").value, 10),
  };
  controller = new AbortController();
  setBusy(true);
  let finish = null, usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : response.status + " " + response.statusText);
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      let events;
      [events, buffer] = splitEvents(buffer + value);
      for (const data of events) {
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices) {
          if (choice.delta && choice.delta.content) reply.textContent += choice.delta.content;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        reply.scrollIntoView({ block: "end" });
      }
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else addMessage("error", err.message);
  } finally {
    reply.classList.remove("streaming");
    history.push({ role: "assistant", content: reply.textContent });
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = (finish ? "finished: " + finish : "") + (usage ? " · " + usage.completion_tokens + " tokens" : "");
    reply.appendChild(meta);
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("status").textContent = busy ? "generating…" : "";
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => { history.length = 0; $("conversation").replaceChildren(); });
$("api_key").addEventListener("change", loadModel);
loadModel();
