// The diffgemma page: chat with streamed replies, the canvas of each denoise step, and question schemas.
// Plain JavaScript, no build step and no network beyond this server. Text from the model or the user is only
// ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // the conversation in the OpenAI message format
let modelId = null;
let controller = null;  // the running request's AbortController

function apiKey() { return sessionStorage.getItem("diffgemma-key") || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
  return h;
}

function askForKey(message) {
  $("key-error").textContent = message || "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

async function loadModel() {
  const resp = await fetch("/v1/models", { headers: headers() });
  if (resp.status === 401) {
    askForKey(apiKey() ? "That key was refused." : "");
    return false;
  }
  if (!resp.ok) {
    $("status").textContent = await errorText(resp);
    return false;
  }
  const body = await resp.json();
  modelId = body.data[0].id;
  $("model").textContent = modelId;
  $("status").textContent = "ready";
  return true;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  box.appendChild(el("span", "who", role === "user" ? "you" : "model"));
  const thought = el("details", "thought");
  thought.appendChild(el("summary", null, "thought"));
  const thoughtText = el("div");
  thought.appendChild(thoughtText);
  thought.hidden = true;
  box.appendChild(thought);
  const body = el("div", "text", text || "");
  box.appendChild(body);
  const calls = el("div", "calls");
  box.appendChild(calls);
  $("messages").appendChild(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return { box, thought, thoughtText, body, calls };
}

// -- the canvas ---------------------------------------------------------------------------------------------

function visible(piece) {
  return piece.replace(/\n/g, "\u21b5").replace(/ /g, "\u00b7") || "\u2205";
}

function renderCanvas(frame) {
  const grid = $("canvas");
  while (grid.children.length < frame.tokens.length) grid.appendChild(el("span", "cell"));
  while (grid.children.length > frame.tokens.length) grid.lastChild.remove();
  frame.tokens.forEach((piece, i) => {
    const cell = grid.children[i];
    const h = frame.entropy[i];
    cell.textContent = visible(piece);
    cell.className = "cell " + (frame.accepted[i] ? "accepted" : "renoised");
    cell.style.setProperty("--shade", (0.85 - 0.7 * Math.min(1, h / 4)).toFixed(2));
    cell.title = `row ${i}: ${JSON.stringify(piece)}, entropy ${h.toFixed(3)}`;
  });
  grid.dataset.block = frame.block;
  grid.dataset.step = frame.step;
  const accepted = frame.accepted.filter(Boolean).length;
  $("canvas-status").textContent =
    `block ${frame.block} \u00b7 step ${frame.step} \u00b7 temperature ${frame.temperature} \u00b7 ` +
    `${accepted}/${frame.tokens.length} accepted`;
}

// -- streaming ----------------------------------------------------------------------------------------------

async function* sseEvents(resp) {
  // Yields {event, data} for each server-sent event of the response body.
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = null;
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

function renderCalls(view, calls) {
  view.calls.replaceChildren(...calls.map((c) => el("div", "call", `call ${c.name}(${c.arguments})`)));
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const view = addMessage("assistant");
  const interval = Math.max(0, parseInt($("interval").value || "0", 10));
  const body = {
    model: modelId,
    messages: conversation,
    stream: true,
    seed: parseInt($("seed").value || "0", 10),
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
    stream_options: { canvas: true, canvas_interval_ms: interval },
  };
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  $("status").textContent = "generating";
  let content = "", reasoning = "";
  const calls = [];
  let sawFrame = false;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (resp.status === 401) { askForKey("That key was refused."); throw new Error("needs an API key"); }
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const ev of sseEvents(resp)) {
      if (ev.data === "[DONE]") break;
      const obj = JSON.parse(ev.data);
      if (ev.event === "canvas") { renderCanvas(obj); sawFrame = true; continue; }
      if (obj.error) throw new Error(obj.error.message);
      const choice = obj.choices && obj.choices[0];
      if (!choice) continue;
      const d = choice.delta || {};
      if (d.reasoning_content) {
        reasoning += d.reasoning_content;
        view.thought.hidden = false;
        view.thoughtText.textContent = reasoning;
      }
      if (d.content) {
        content += d.content;
        view.body.textContent = content;
        if (sawFrame) $("canvas-status").textContent += " \u00b7 committed";
      }
      for (const tc of d.tool_calls || []) {
        const c = calls[tc.index] || (calls[tc.index] = { id: tc.id, name: "", arguments: "" });
        if (tc.function && tc.function.name) c.name += tc.function.name;
        if (tc.function && tc.function.arguments) c.arguments += tc.function.arguments;
        renderCalls(view, calls);
      }
      if (choice.finish_reason) $("status").textContent = "finished: " + choice.finish_reason;
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  } catch (err) {
    if (err.name === "AbortError") {
      view.box.appendChild(el("div", "note", "(stopped)"));
      $("status").textContent = "stopped";
    } else {
      view.box.appendChild(el("div", "error", String(err.message || err)));
      $("status").textContent = "error";
    }
  } finally {
    const msg = { role: "assistant", content };
    if (calls.length) {
      msg.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    if (content || calls.length) conversation.push(msg);
    else conversation.pop();  // nothing came back: the user's turn is dropped with it
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// -- question schemas ---------------------------------------------------------------------------------------

async function score() {
  $("answers").replaceChildren();
  $("ask-status").textContent = "scoring";
  let schema, state;
  try {
    schema = JSON.parse($("schema").value);
    state = JSON.parse($("state").value);
  } catch (err) {
    $("ask-status").textContent = "not JSON: " + err.message;
    return;
  }
  const body = {
    model: modelId,
    messages: [
      { role: "system", content: JSON.stringify(schema) },
      { role: "user", content: JSON.stringify(state) },
    ],
  };
  const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (resp.status === 401) { askForKey("That key was refused."); $("ask-status").textContent = ""; return; }
  if (!resp.ok) { $("ask-status").textContent = await errorText(resp); return; }
  const reply = JSON.parse((await resp.json()).choices[0].message.content);
  for (const [id, a] of Object.entries(reply.answers)) {
    const box = el("div", "answer");
    box.appendChild(el("div", null, `${id}: ${a.label} (confidence ${(100 * a.confidence).toFixed(1)}%)`));
    for (const [name, p] of Object.entries(a.probabilities)) {
      const bar = el("div", "bar");
      bar.appendChild(el("span", null, name));
      const track = el("div");
      const fill = el("div", "fill");
      fill.style.width = (100 * p).toFixed(1) + "%";
      track.appendChild(fill);
      bar.appendChild(track);
      bar.appendChild(el("span", null, (100 * p).toFixed(1) + "%"));
      box.appendChild(bar);
    }
    $("answers").appendChild(box);
  }
  $("ask-status").textContent = `${reply.diagnostics.samples.n} read(s)`;
}

// -- wiring -------------------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller || !modelId) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("messages").replaceChildren();
});
$("ask").addEventListener("click", () => { score().catch((err) => { $("ask-status").textContent = String(err); }); });
$("key-open").addEventListener("click", () => askForKey(""));
$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem("diffgemma-key", $("key-input").value.trim());
  $("key-input").value = "";
  loadModel();
});
loadModel();
