//! The Rust examples of the repository's guides, compiled and run as doc
//! tests: `README.md` and every `docs/*.md`.
//!
//! Run with: `cargo test -p example-docs`
//!
//! The guides are not inside any published crate, and a package may only
//! include its own files, so they are tested here, in a crate that is never
//! published. Each guide is a hidden item whose doc comment is the file:
//! rustdoc runs its `rust` blocks (`no_run` ones are compiled only) and
//! skips the `sh`, `toml`, `json` and `text` ones.

#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct Readme;

#[doc = include_str!("../../../docs/architecture.md")]
#[cfg(doctest)]
pub struct Architecture;

#[doc = include_str!("../../../docs/algorithms.md")]
#[cfg(doctest)]
pub struct Algorithms;

#[doc = include_str!("../../../docs/budgets.md")]
#[cfg(doctest)]
pub struct Budgets;

#[doc = include_str!("../../../docs/distributed.md")]
#[cfg(doctest)]
pub struct Distributed;

#[doc = include_str!("../../../docs/envoy.md")]
#[cfg(doctest)]
pub struct Envoy;

#[doc = include_str!("../../../docs/integrations.md")]
#[cfg(doctest)]
pub struct Integrations;

#[doc = include_str!("../../../docs/middleware.md")]
#[cfg(doctest)]
pub struct Middleware;

#[doc = include_str!("../../../docs/proxy.md")]
#[cfg(doctest)]
pub struct Proxy;

#[doc = include_str!("../../../docs/reliability.md")]
#[cfg(doctest)]
pub struct Reliability;

#[doc = include_str!("../../../docs/runtime-limits.md")]
#[cfg(doctest)]
pub struct RuntimeLimits;

#[doc = include_str!("../../../docs/security.md")]
#[cfg(doctest)]
pub struct Security;

#[doc = include_str!("../../../docs/server.md")]
#[cfg(doctest)]
pub struct Server;

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// A guide added to docs/ is tested only once it is included above:
    /// this fails until it is.
    #[test]
    fn every_guide_is_a_doc_test() {
        let lib = include_str!("lib.rs");
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
        let mut guides = 0;
        for entry in std::fs::read_dir(&docs).expect("docs/ is readable") {
            let name = entry.expect("a docs/ entry").file_name();
            let name = name.to_str().expect("a UTF-8 file name");
            if name.ends_with(".md") {
                let include = format!("include_str!(\"../../../docs/{name}\")");
                assert!(lib.contains(&include), "docs/{name} is not a doc test");
                guides += 1;
            }
        }
        assert!(guides > 0, "no guides found in {}", docs.display());
    }
}
