//! docs/middleware.md's `Cargo.toml` snippet: what an app adds to depend on
//! Spillway is what this crate builds the guides' examples with.

use std::collections::BTreeSet;
use std::path::Path;

fn read(path: &Path) -> toml::Table {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The first ```toml block of `markdown` that has a `[dependencies]` table.
fn dependencies_block(markdown: &str) -> toml::Table {
    markdown
        .split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .find(|block| block.contains("[dependencies]"))
        .expect("a ```toml block with [dependencies]")
        .parse()
        .expect("the block is TOML")
}

fn features(dep: &toml::Value) -> BTreeSet<String> {
    dep.get("features")
        .and_then(toml::Value::as_array)
        .into_iter()
        .flatten()
        .map(|f| f.as_str().expect("a feature name").to_string())
        .collect()
}

#[test]
fn the_middleware_guides_dependencies_are_the_ones_its_examples_build_with() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let guide = std::fs::read_to_string(root.join("docs/middleware.md")).expect("the guide");
    let snippet = dependencies_block(&guide);
    let snippet = snippet["dependencies"].as_table().expect("a table");
    let ours = read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
    let ours = ours["dev-dependencies"].as_table().expect("a table");
    let workspace = read(&root.join("Cargo.toml"));
    let workspace = workspace["workspace"]["dependencies"]
        .as_table()
        .expect("a table");

    let named: BTreeSet<_> = snippet.keys().collect();
    // `toml` reads this very check; the guides do not use it.
    let used: BTreeSet<_> = ours.keys().filter(|k| *k != "toml").collect();
    assert_eq!(named, used, "the guide's crates and the examples' crates");
    for (name, dep) in snippet {
        let ws = &workspace[name.as_str()];
        if name.starts_with("spillway") {
            // A checkout of this repository beside the app.
            let path = ws["path"].as_str().expect("a path");
            assert_eq!(
                dep["path"].as_str(),
                Some(format!("../spillway/{path}").as_str()),
                "{name}"
            );
            let manifest = read(&root.join(path).join("Cargo.toml"));
            assert_eq!(manifest["package"]["name"].as_str(), Some(name.as_str()));
            assert_ne!(
                manifest["package"]
                    .get("publish")
                    .and_then(toml::Value::as_bool),
                Some(false),
                "{name} is a crate meant for apps"
            );
        } else {
            assert_eq!(dep["version"].as_str(), ws["version"].as_str(), "{name}");
            let given = features(dep);
            let mut needed = features(&ours[name.as_str()]);
            if dep.get("default-features").and_then(toml::Value::as_bool) == Some(false) {
                needed.extend(features(ws));
            }
            assert!(
                given.is_superset(&needed),
                "{name}: the guide enables {given:?}, the examples need {needed:?}"
            );
        }
    }
}
