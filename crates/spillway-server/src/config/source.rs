//! Where a configuration comes from: the file, the sample, and the
//! command line's overrides.

use std::path::{Path, PathBuf};

use spillway_redis::Topology;

use super::{Config, ConfigErrors, StoreKind};

/// The sample configuration that ships in the repository
/// (`config/spillway.toml`): what `spillway serve` runs when it finds no
/// configuration file.
pub const SAMPLE_CONFIG: &str = include_str!("../../config/spillway.toml");

/// Where `spillway serve` looks for its configuration when not told.
pub const DEFAULT_CONFIG_PATH: &str = "config/spillway.toml";

/// Command-line settings that take precedence over the configuration file,
/// on start and on every reload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--redis URL`: use this Redis whatever `[store] kind` says.
    pub redis: Option<String>,
}

impl Overrides {
    /// Applies the overrides to a configuration.
    pub fn apply(&self, config: &mut Config) {
        if let Some(url) = &self.redis {
            config.store.kind = StoreKind::Redis(Topology::Standalone(url.clone()));
        }
    }
}

/// The configuration file a service was started from, and what overrides it:
/// what a reload reads again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigSource {
    /// The file.
    pub path: PathBuf,
    /// The command-line settings that win over it.
    pub overrides: Overrides,
}

impl From<PathBuf> for ConfigSource {
    fn from(path: PathBuf) -> Self {
        Self {
            path,
            overrides: Overrides::default(),
        }
    }
}

impl ConfigSource {
    /// Reads and validates the file, then applies the overrides.
    pub fn load(&self) -> Result<Config, ConfigErrors> {
        let mut config = Config::load(&self.path)?;
        self.overrides.apply(&mut config);
        Ok(config)
    }
}

/// The configuration file to use: `explicit` if given, else
/// [`DEFAULT_CONFIG_PATH`] if it exists (relative to the working
/// directory), else none (and [`SAMPLE_CONFIG`] is used).
pub fn locate_config(explicit: Option<PathBuf>) -> Option<PathBuf> {
    explicit.or_else(|| {
        let default = Path::new(DEFAULT_CONFIG_PATH);
        default.is_file().then(|| default.to_path_buf())
    })
}
