//! The process: command line, logging, the tokio runtime, signals and the exit code.

use crate::cli::{self, Command, LogFormat};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// The operator process: parses the command line (a bad value is one line naming the flag,
/// exit code 2), then prints the CRD, the version, or runs until SIGTERM or Ctrl-C.
pub fn main() {
    let cli = cli::parse();
    match cli.command {
        Command::Crd { kind } => print!("{}", crate::crdgen::crd_yaml(kind)),
        Command::Version => println!("consul-resolver-operator {}", env!("CARGO_PKG_VERSION")),
        Command::Run(args) => {
            keep_large_buffers_out_of_the_heap();
            init_logging(cli.log_format);
            // One TLS provider for kube and reqwest alike.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
            let result = runtime.block_on(async {
                let shutdown = CancellationToken::new();
                // Registered before anything listens: a SIGTERM from then on is a shutdown.
                tokio::spawn(signals(shutdown.clone(), term_signal()));
                crate::runtime::run(*args, shutdown).await
            });
            if let Err(e) = result {
                tracing::error!(error = format!("{e:#}"), "exiting");
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        }
    }
}

/// Serves every allocation of 128 KiB or more with its own mapping, returned to the system
/// when freed. glibc's default raises that threshold each time such a block is freed, after
/// which the multi-megabyte buffers of every publication (the snapshot's JSON, its gzip,
/// the ConfigMap's parts) come from the heap and fragment it: measured at 1,000 services
/// and 1,200 Consul connections, resident memory grew from 90 to 119 MiB over 40 changes
/// with the default and stayed at 91 MiB with a fixed threshold (docs/benchmarks.md). An
/// operator who sets `MALLOC_MMAP_THRESHOLD_` keeps their own value.
fn keep_large_buffers_out_of_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets a tuning parameter of the allocator; it is called before
        // the runtime starts any thread that allocates concurrently.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,kube=warn,hyper=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The SIGTERM handler, installed when called.
fn term_signal() -> tokio::signal::unix::Signal {
    use tokio::signal::unix::{SignalKind, signal};
    signal(SignalKind::terminate()).expect("cannot install a SIGTERM handler")
}

/// SIGTERM (Kubernetes) or Ctrl-C: shut down gracefully.
async fn signals(shutdown: CancellationToken, mut term: tokio::signal::unix::Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
}
