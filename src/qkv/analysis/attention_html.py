"""A self-contained interactive attention page (note 000 §14; SPEC F2): one HTML file, inline data,
script and style, nothing fetched (no network, no CDN).

Pick a layer and a head; the heat map shows A (row = query, column = key). Hover a token (or a heat-map
row) to colour every token by how much that query attends to it. The state can also be set from the URL
fragment, `page.html#layer=1&head=0&token=5`, which is how headless tests drive it; `#status` then names
the key the token attends to most.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
#controls { margin-bottom: 10px; } select { margin-right: 14px; }
#tokens { line-height: 2.1; margin: 10px 0; max-width: 900px; }
.tok { padding: 2px 3px; margin: 1px; border: 1px solid #ccc; border-radius: 3px; cursor: pointer;
       white-space: pre; font-family: ui-monospace, monospace; }
.tok.query { outline: 2px solid #d62728; }
#status { margin: 8px 0; font-family: ui-monospace, monospace; }
canvas { border: 1px solid #999; image-rendering: pixelated; }
"""

SCRIPT = """
const DATA = JSON.parse(document.getElementById('attention-data').textContent);
const state = {layer: 0, head: 0, token: -1};
const layerSel = document.getElementById('layer'), headSel = document.getElementById('head');
const tokensDiv = document.getElementById('tokens'), canvas = document.getElementById('heat');
const statusDiv = document.getElementById('status');
const T = DATA.tokens.length, CELL = Math.max(6, Math.min(24, Math.floor(480 / T)));
canvas.width = canvas.height = T * CELL;

function weights() { return DATA.maps[state.layer][state.head]; }
function color(w) { const c = Math.round(255 * (1 - w)); return `rgb(${c},${Math.round(255 - 120 * w)},255)`; }

function drawHeat() {
  const ctx = canvas.getContext('2d'), A = weights();
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    ctx.fillStyle = color(A[i][j]); ctx.fillRect(j * CELL, i * CELL, CELL, CELL);
  }
  if (state.token >= 0) {
    ctx.strokeStyle = '#d62728'; ctx.lineWidth = 2;
    ctx.strokeRect(1, state.token * CELL + 1, T * CELL - 2, CELL - 2);
  }
}

function colourTokens() {
  const spans = tokensDiv.children, A = weights();
  for (let j = 0; j < T; j++) {
    const w = state.token >= 0 ? A[state.token][j] : 0;
    spans[j].style.background = state.token >= 0 ? color(w) : '';
    spans[j].title = state.token >= 0 ? `weight ${w.toFixed(3)}` : '';
    spans[j].classList.toggle('query', j === state.token);
  }
  if (state.token < 0) { statusDiv.textContent = 'hover a token'; return; }
  const row = A[state.token];
  let best = 0;
  for (let j = 1; j < T; j++) if (row[j] > row[best]) best = j;
  statusDiv.textContent = `${DATA.names[state.layer]} head ${state.head}: token ${state.token} ` +
    `${JSON.stringify(DATA.tokens[state.token])} attends most to token ${best} ` +
    `${JSON.stringify(DATA.tokens[best])} (${row[best].toFixed(3)})`;
  statusDiv.dataset.best = best;
}

function render() { layerSel.value = state.layer; headSel.value = state.head; drawHeat(); colourTokens(); }

DATA.names.forEach((name, l) => layerSel.add(new Option(name, l)));
for (let h = 0; h < DATA.maps[0].length; h++) headSel.add(new Option('head ' + h, h));
DATA.tokens.forEach((text, i) => {
  const span = document.createElement('span');
  span.className = 'tok'; span.textContent = text; span.dataset.index = i;
  span.addEventListener('mouseenter', () => { state.token = i; render(); });
  tokensDiv.appendChild(span);
});
canvas.addEventListener('mousemove', e => {
  const i = Math.floor(e.offsetY / CELL); if (i >= 0 && i < T && i !== state.token) { state.token = i; render(); }
});
layerSel.addEventListener('change', () => { state.layer = +layerSel.value; render(); });
headSel.addEventListener('change', () => { state.head = +headSel.value; render(); });

function fromHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const clamp = (v, n) => Math.max(0, Math.min(n - 1, v));
  if (params.has('layer')) state.layer = clamp(+params.get('layer'), DATA.maps.length);
  if (params.has('head')) state.head = clamp(+params.get('head'), DATA.maps[0].length);
  if (params.has('token')) state.token = clamp(+params.get('token'), T);
}
window.addEventListener('hashchange', () => { fromHash(); render(); });
fromHash(); render();
document.body.dataset.ready = '1';
"""


def page(maps: list[np.ndarray], tokens: list[str], names: list[str], title: str = "qkv attention") -> str:
    """The HTML text: maps[l] is (H, T, T) for layer names[l]; tokens are the T token strings."""
    data = {"tokens": tokens, "names": names,
            "maps": [np.round(np.asarray(m, dtype=np.float64), 4).tolist() for m in maps]}
    payload = json.dumps(data).replace("</", "<\\/")  # a token "</script>" cannot end the data block
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h3>{html.escape(title)}</h3>
<div id="controls"><label>layer <select id="layer"></select></label><label>head <select id="head"></select></label></div>
<div id="tokens"></div>
<div id="status"></div>
<canvas id="heat"></canvas>
<p>A = softmax(QK<sup>T</sup>/&radic;d<sub>k</sub> + M) (note 000 &sect;14): row = query, column = key.</p>
<script type="application/json" id="attention-data">{payload}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write(maps: list[np.ndarray], tokens: list[str], names: list[str], out: Path, title: str = "qkv attention") -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(maps, tokens, names, title), encoding="utf-8")
    return out
