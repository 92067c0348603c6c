// Small canvas plots for the viewer: per-step lines and bars with a cursor and episode
// boundaries, and histograms. Drawn in the page, nothing fetched from elsewhere.
"use strict";

const Plot = (() => {
  const PALETTE = ["#1570ef", "#e04f16", "#12b76a", "#9e77ed", "#f79009", "#ee46bc", "#0e9384", "#667085"];
  const PAD = { left: 46, right: 10, top: 8, bottom: 18 };

  // The canvas's 2D context sized to its CSS box at the screen's pixel ratio.
  function context(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 600;
    const height = canvas.clientHeight || 110;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height };
  }

  function range(values) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const v of values) {
      if (Number.isFinite(v)) {
        lo = Math.min(lo, v);
        hi = Math.max(hi, v);
      }
    }
    if (lo === Infinity) return [0, 1];
    if (lo === hi) return [lo - 1, hi + 1];
    const pad = (hi - lo) * 0.05;
    return [lo - pad, hi + pad];
  }

  function label(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a < 0.01 || a >= 1e5)) return v.toExponential(1);
    return String(Math.round(v * 100) / 100);
  }

  // Per-step values over steps 0..steps-1: `lines` [{values, color}] drawn as lines, or as
  // bars with kind "bars"; `ends` the steps where an episode ended (a dashed line after each);
  // `cursor` the step shown. Returns the step at a canvas x position, for clicks.
  function steps(canvas, { steps, lines, kind = "line", ends = [], cursor = null, lo = null, hi = null }) {
    const { ctx, width, height } = context(canvas);
    const all = lines.flatMap((l) => l.values);
    let [y0, y1] = range(all);
    if (lo !== null) y0 = lo;
    if (hi !== null) y1 = hi;
    const w = width - PAD.left - PAD.right;
    const h = height - PAD.top - PAD.bottom;
    const slot = w / Math.max(1, steps);
    const x = (s) => PAD.left + (s + 0.5) * slot;
    const y = (v) => PAD.top + h - ((v - y0) / (y1 - y0)) * h;

    ctx.fillStyle = "#f9fafb";
    ctx.fillRect(PAD.left, PAD.top, w, h);
    ctx.strokeStyle = "#d0d5dd";
    ctx.lineWidth = 1;
    ctx.strokeRect(PAD.left + 0.5, PAD.top + 0.5, w - 1, h - 1);
    ctx.fillStyle = "#667085";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(label(y1), PAD.left - 4, PAD.top + 6);
    ctx.fillText(label(y0), PAD.left - 4, PAD.top + h - 6);
    if (y0 < 0 && y1 > 0) {
      ctx.strokeStyle = "#d0d5dd";
      ctx.beginPath();
      ctx.moveTo(PAD.left, y(0));
      ctx.lineTo(PAD.left + w, y(0));
      ctx.stroke();
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.max(1, Math.ceil(steps / 10));
    for (let s = 0; s < steps; s += every) ctx.fillText(String(s), x(s), PAD.top + h + 3);

    ctx.strokeStyle = "#98a2b3";
    ctx.setLineDash([4, 3]);
    for (const e of ends) {
      const at = PAD.left + (e + 1) * slot;
      ctx.beginPath();
      ctx.moveTo(at, PAD.top);
      ctx.lineTo(at, PAD.top + h);
      ctx.stroke();
    }
    ctx.setLineDash([]);

    lines.forEach((line, i) => {
      const color = line.color || PALETTE[i % PALETTE.length];
      if (kind === "bars") {
        ctx.fillStyle = color;
        const base = y(Math.max(y0, Math.min(y1, 0)));
        line.values.forEach((v, s) => {
          if (!Number.isFinite(v) || v === 0) return;
          const top = y(v);
          ctx.fillRect(x(s) - slot * 0.35, Math.min(top, base), slot * 0.7, Math.max(1, Math.abs(base - top)));
        });
        return;
      }
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      line.values.forEach((v, s) => {
        if (!Number.isFinite(v)) {
          pen = false;
          return;
        }
        if (pen) ctx.lineTo(x(s), y(v));
        else ctx.moveTo(x(s), y(v));
        pen = true;
      });
      ctx.stroke();
      if (steps <= 64) {
        ctx.fillStyle = color;
        line.values.forEach((v, s) => {
          if (Number.isFinite(v)) ctx.fillRect(x(s) - 1.5, y(v) - 1.5, 3, 3);
        });
      }
    });

    if (cursor !== null) {
      ctx.fillStyle = "rgba(21, 112, 239, 0.12)";
      ctx.fillRect(x(cursor) - slot / 2, PAD.top, slot, h);
      ctx.strokeStyle = "#1570ef";
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      ctx.moveTo(x(cursor), PAD.top);
      ctx.lineTo(x(cursor), PAD.top + h);
      ctx.stroke();
    }
    return (clientX) => {
      const box = canvas.getBoundingClientRect();
      const s = Math.floor((clientX - box.left - PAD.left) / slot);
      return Math.max(0, Math.min(steps - 1, s));
    };
  }

  // A histogram: counts between edges (len(edges) = len(counts) + 1).
  function histogram(canvas, { counts, color = PALETTE[0] }) {
    const { ctx, width, height } = context(canvas);
    const top = Math.max(1, ...counts);
    const slot = width / Math.max(1, counts.length);
    ctx.fillStyle = color;
    counts.forEach((c, i) => {
      const bar = (c / top) * (height - 4);
      if (c > 0) ctx.fillRect(i * slot + 1, height - Math.max(1, bar), Math.max(1, slot - 2), Math.max(1, bar));
    });
  }

  // Observed against expected shares per item: filled bars and a line each, the items' ids
  // (some of them, when there are many) below.
  function shares(canvas, { observed, expected, id = [] }) {
    const { ctx, width, height } = context(canvas);
    const top = Math.max(1e-12, ...observed, ...expected);
    const slot = (width - 8) / Math.max(1, observed.length);
    const h = height - 22;
    ctx.fillStyle = "#667085";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const every = Math.max(1, Math.ceil(id.length / 20));
    id.forEach((name, i) => {
      if (i % every === 0) ctx.fillText(String(name), 4 + (i + 0.5) * slot, h + 8);
    });
    observed.forEach((v, i) => {
      ctx.fillStyle = PALETTE[0];
      const bar = (v / top) * h;
      ctx.fillRect(4 + i * slot + slot * 0.15, 4 + h - bar, Math.max(1, slot * 0.7), bar);
      ctx.strokeStyle = PALETTE[1];
      ctx.lineWidth = 1.5;
      const e = 4 + h - (expected[i] / top) * h;
      ctx.beginPath();
      ctx.moveTo(4 + i * slot, e);
      ctx.lineTo(4 + (i + 1) * slot, e);
      ctx.stroke();
    });
  }

  return { steps, histogram, shares, PALETTE };
})();
