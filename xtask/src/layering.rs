//! The layering check of `cargo xtask test`: a crate's modules import one way only.
//!
//! A crate's `lib.rs` declares its modules in layers, lowest first, each opened by a comment
//! `// layer: NAME — what it holds`. A module may import from its own layer and those declared
//! before it, never from one after it; and no modules may import each other round in a cycle,
//! at any depth (a folder's submodules among themselves too). Imports are read from the source
//! as text — `crate::`, `super::` and `self::` paths, and a folder's `use child::` — in the
//! production code (a file's `#[cfg(test)] mod` and what follows it are left out; comments
//! too). Every violation is named with the file and line of the import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// One import: from a module to another, where it is written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Import {
    from: String,
    to: String,
    file: PathBuf,
    line: usize,
}

/// Checks the crate whose sources are in `src`; the error lists every violation.
pub fn check(src: &Path) -> anyhow::Result<()> {
    let layers = layers(&src.join("lib.rs"))?;
    // Files are named from the repository's root (`sidecar/src/replica/pool.rs`).
    let base = src.ancestors().nth(2).unwrap_or(src);
    let modules: BTreeMap<String, PathBuf> = modules(src)?
        .into_iter()
        .map(|(m, f)| {
            let short = f.strip_prefix(base).map(Path::to_path_buf).unwrap_or(f);
            (m, short)
        })
        .collect();
    let mut imports = Vec::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(base.join(file))
            .with_context(|| format!("reading {}", file.display()))?;
        imports.extend(imports_of(module, file, &text, &modules));
    }
    let mut problems = Vec::new();
    for i in &imports {
        let (from, to) = (top(&i.from), top(&i.to));
        if from == to {
            continue;
        }
        let layer = |m: &str| layers.iter().position(|(_, ms)| ms.contains(m));
        match (layer(from), layer(to)) {
            (Some(a), Some(b)) if b > a => problems.push(format!(
                "{}:{}: `{}` (layer {}) imports `{}` (layer {}, declared after it in lib.rs)",
                i.file.display(),
                i.line,
                i.from,
                layers[a].0,
                i.to,
                layers[b].0
            )),
            (None, _) => problems.push(format!(
                "{}: `{from}` is in no layer of lib.rs",
                i.file.display()
            )),
            _ => {}
        }
    }
    problems.extend(cycles(&imports));
    problems.sort();
    problems.dedup();
    if problems.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} layering violation(s) in {}:\n{}",
            problems.len(),
            src.display(),
            problems.join("\n")
        )
    }
}

/// The layers `lib.rs` declares, lowest first: each name and its modules.
fn layers(lib: &Path) -> anyhow::Result<Vec<(String, BTreeSet<String>)>> {
    let text =
        std::fs::read_to_string(lib).with_context(|| format!("reading {}", lib.display()))?;
    let mut layers: Vec<(String, BTreeSet<String>)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("// layer:") {
            let name = rest.split('—').next().unwrap_or(rest).trim();
            layers.push((name.to_owned(), BTreeSet::new()));
        } else if let Some(module) = declared(line) {
            let Some(layer) = layers.last_mut() else {
                bail!(
                    "{}:{}: `mod {module}` comes before any `// layer:` line",
                    lib.display(),
                    n + 1
                );
            };
            layer.1.insert(module.to_owned());
        }
    }
    if layers.is_empty() {
        bail!("{}: no `// layer:` lines", lib.display());
    }
    Ok(layers)
}

/// The module a `mod NAME;` line declares (public or not).
fn declared(line: &str) -> Option<&str> {
    let rest = line
        .strip_prefix("pub mod ")
        .or_else(|| line.strip_prefix("pub(crate) mod "))
        .or_else(|| line.strip_prefix("mod "))?;
    rest.strip_suffix(';')
}

/// Every module file under `src` (not the crate roots) by its path: `config/mod.rs` is
/// `config`, `config/engine.rs` is `config::engine`.
fn modules(src: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src)?.with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts.len() == 1 && matches!(parts[0].as_str(), "lib" | "main") {
                continue;
            }
            out.insert(parts.join("::"), path);
        }
    }
    Ok(out)
}

/// The top-level module of a module path.
fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// The imports in `text`, the file of `module`, that name another module of `modules`.
fn imports_of(
    module: &str,
    file: &Path,
    text: &str,
    modules: &BTreeMap<String, PathBuf>,
) -> Vec<Import> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    while let Some((n, line)) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|(_, next)| next.trim_start().starts_with("mod "))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = line.split("//").next().unwrap_or(line);
        for path in paths(module, code) {
            if let Some(to) = resolve(&path, modules)
                && to != module
                && !module.starts_with(&format!("{to}::"))
            {
                out.push(Import {
                    from: module.to_owned(),
                    to,
                    file: file.to_path_buf(),
                    line: n + 1,
                });
            }
        }
    }
    out
}

/// The module paths a line of `module`'s code names, made absolute: `crate::a::b`, `super::b`
/// and `self::b` paths, the names inside a `crate::{..}` group, and `use b::..` of its own
/// submodule `b`.
fn paths(module: &str, code: &str) -> Vec<Vec<String>> {
    let own: Vec<String> = module.split("::").map(str::to_owned).collect();
    let mut out = Vec::new();
    let words = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|w| {
                w.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|w| !w.is_empty())
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or("");
            out.extend(inner.split(',').map(|item| words(item.trim())));
        } else {
            out.push(words(rest));
        }
    }
    for (prefix, base) in [
        ("super::", own[..own.len().saturating_sub(1)].to_vec()),
        ("self::", own.clone()),
    ] {
        for (i, _) in code.match_indices(prefix) {
            if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut path = base.clone();
            path.extend(words(&code[i + prefix.len()..]));
            out.push(path);
        }
    }
    if let Some(rest) = code.trim_start().strip_prefix("use ")
        && !rest.starts_with("crate::")
        && !rest.starts_with("super::")
        && !rest.starts_with("self::")
    {
        let mut path = own;
        path.extend(words(rest));
        out.push(path);
    }
    out
}

/// The deepest module of `modules` that `path` names, if any.
fn resolve(path: &[String], modules: &BTreeMap<String, PathBuf>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains_key(m))
}

/// Every cycle among the modules, each as its modules in order with where each import is.
fn cycles(imports: &[Import]) -> Vec<String> {
    let mut graph: BTreeMap<&str, BTreeMap<&str, &Import>> = BTreeMap::new();
    for i in imports {
        graph.entry(&i.from).or_default().entry(&i.to).or_insert(i);
        graph.entry(&i.to).or_default();
    }
    let mut problems = Vec::new();
    for component in strongly_connected(&graph) {
        // One cycle through the component: from its first module, a shortest way back.
        let start = component[0];
        let Some(cycle) = way_back(&graph, start, &component) else {
            continue;
        };
        let steps: Vec<String> = cycle
            .windows(2)
            .map(|w| {
                let i = graph[w[0]][w[1]];
                format!(
                    "  `{}` imports `{}` at {}:{}",
                    i.from,
                    i.to,
                    i.file.display(),
                    i.line
                )
            })
            .collect();
        problems.push(format!(
            "an import cycle among {} modules ({}):\n{}",
            component.len(),
            component.join(", "),
            steps.join("\n")
        ));
    }
    problems
}

/// The components of more than one module (Tarjan's algorithm).
fn strongly_connected<'a>(
    graph: &BTreeMap<&'a str, BTreeMap<&'a str, &Import>>,
) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(
        v: &'a str,
        graph: &BTreeMap<&'a str, BTreeMap<&'a str, &Import>>,
        s: &mut State<'a>,
    ) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
            if !s.index.contains_key(w) {
                visit(w, graph, s);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w);
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort_unstable();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(v, graph, &mut s);
        }
    }
    s.out
}

/// A shortest path from `start` back to it within `component` (breadth first).
fn way_back<'a>(
    graph: &BTreeMap<&'a str, BTreeMap<&'a str, &Import>>,
    start: &'a str,
    component: &[&'a str],
) -> Option<Vec<&'a str>> {
    let inside: BTreeSet<&str> = component.iter().copied().collect();
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for &w in graph[v].keys().filter(|w| inside.contains(*w)) {
            if w == start {
                let mut path = vec![start, v];
                let mut at = v;
                while let Some(&prev) = came_from.get(at) {
                    path.push(prev);
                    at = prev;
                }
                path.reverse();
                path.rotate_right(1);
                path.push(start);
                path.dedup();
                return Some(path);
            }
            if w != start && !came_from.contains_key(w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A crate in a temporary directory: `files` as (path under src, text).
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    const LIB: &str = "// layer: support — leaves\npub mod clock;\n\n// layer: dispatch — the loop\npub mod dispatcher;\npub mod pool;\n";

    #[test]
    fn imports_down_the_layers_pass() {
        let dir = tree(&[
            ("lib.rs", LIB),
            ("clock.rs", "pub fn now() {}\n"),
            ("pool.rs", "use crate::clock::now;\n"),
            (
                "dispatcher.rs",
                "use crate::pool::Pool;\nuse crate::clock;\n",
            ),
        ]);
        check(dir.path()).unwrap();
    }

    #[test]
    fn an_import_up_the_layers_is_named_with_its_file_and_line() {
        let dir = tree(&[
            ("lib.rs", LIB),
            (
                "clock.rs",
                "//! The clock.\n\nuse crate::dispatcher::Event;\n",
            ),
            ("pool.rs", ""),
            ("dispatcher.rs", ""),
        ]);
        let e = check(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("clock.rs:3: `clock` (layer support) imports `dispatcher` (layer dispatch"),
            "{e}"
        );
    }

    #[test]
    fn a_cycle_within_a_layer_or_a_folder_is_named_step_by_step() {
        let dir = tree(&[
            ("lib.rs", LIB),
            ("clock.rs", ""),
            ("pool.rs", "fn f() { crate::dispatcher::now(); }\n"),
            ("dispatcher/mod.rs", "mod event;\nuse crate::pool::Pool;\n"),
            ("dispatcher/event.rs", "use super::run;\n"),
        ]);
        let e = check(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("an import cycle among 2 modules (dispatcher, pool)"),
            "{e}"
        );
        assert!(e.contains("`pool` imports `dispatcher` at"), "{e}");
        assert!(e.contains("pool.rs:1"), "{e}");
        // A child importing its parent is no cycle: the parent declares it, it does not import it.
        assert!(!e.contains("dispatcher::event"), "{e}");
    }

    #[test]
    fn tests_and_comments_are_not_imports() {
        let dir = tree(&[
            ("lib.rs", LIB),
            (
                "clock.rs",
                "/// See [`crate::dispatcher`].\nfn f() {} // crate::pool\n#[cfg(test)]\nmod tests {\n    use crate::dispatcher::Event;\n}\n",
            ),
            ("pool.rs", ""),
            ("dispatcher.rs", ""),
        ]);
        check(dir.path()).unwrap();
    }

    #[test]
    fn a_module_in_no_layer_is_refused() {
        let dir = tree(&[
            ("lib.rs", "pub mod clock;\n// layer: support\n"),
            ("clock.rs", ""),
        ]);
        let e = check(dir.path()).unwrap_err().to_string();
        assert!(e.contains("comes before any `// layer:` line"), "{e}");
    }
}
