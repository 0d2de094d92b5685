//! The `/_sim/` control API: fault injection, the request log and connection statistics.
//!
//! Real Consul has none of this; it exists so that tests can provoke failures and assert on
//! what a client did. See the module documentation of [`crate`] for the endpoint list.
//! Control requests are not subject to faults, ACLs or the request log.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};

use super::catalog::{DeregisterRequest, RegisterRequest, ServiceKey};
use super::faults::FaultsPatch;
use super::state::Shared;
use super::urls::percent_decode;

/// `PUT /_sim/services/<name>/index` and `POST /_sim/reset-index` body.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct IndexBody {
    pub index: u64,
}

type Resp = Response<Full<Bytes>>;

fn json<T: Serialize>(status: StatusCode, value: &T) -> Resp {
    let body = serde_json::to_vec_pretty(value).unwrap_or_else(|_| b"null".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    resp
}

fn text(status: StatusCode, body: impl Into<String>) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body.into())));
    *resp.status_mut() = status;
    resp
}

async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Incoming>, empty_ok: bool) -> Result<Option<T>, Resp> {
    let bytes = Limited::new(req.into_body(), 1 << 20)
        .collect()
        .await
        .map_err(|e| text(StatusCode::BAD_REQUEST, format!("reading body: {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return if empty_ok { Ok(None) } else { Err(text(StatusCode::BAD_REQUEST, "a JSON body is required")) };
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| text(StatusCode::BAD_REQUEST, format!("bad JSON body: {e}")))
}

/// Serves one `/_sim/...` request.
pub(crate) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Resp {
    match route(shared, req).await {
        Ok(r) | Err(r) => r,
    }
}

fn query_param(query: &str, name: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Result<Resp, Resp> {
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();

    if let Some(rest) = path.strip_prefix("/_sim/services/")
        && let Some(name) = rest.strip_suffix("/index")
    {
        return set_service_index(shared, req, name, &query).await;
    }
    if let Some(rest) = path.strip_prefix("/_sim/peers/")
        && let Some((peer, action)) = rest.split_once('/')
    {
        return write_imported(shared, req, peer, action).await;
    }
    fixed_endpoint(shared, req, &path, &query).await
}

/// `PUT /_sim/services/<name>/index`: moves one service's Raft index.
async fn set_service_index(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    name: &str,
    query: &str,
) -> Result<Resp, Resp> {
    if req.method() != Method::PUT {
        return Err(text(StatusCode::METHOD_NOT_ALLOWED, "use PUT"));
    }
    let name = percent_decode(name).ok_or_else(|| text(StatusCode::BAD_REQUEST, "bad service name"))?;
    let body: IndexBody = read_json(req, false).await?.unwrap_or_default();
    let key = ServiceKey::scoped(name, query_param(query, "ns").as_deref(), query_param(query, "partition").as_deref());
    if shared.set_service_index(&key, body.index) {
        Ok(json(StatusCode::OK, &serde_json::json!({"service": key.name, "index": body.index})))
    } else {
        Err(text(StatusCode::NOT_FOUND, format!("unknown service {:?}", key.name)))
    }
}

/// `PUT /_sim/peers/<peer>/{register,deregister}`: what a peer exports, as this cluster imports it.
async fn write_imported(shared: &Arc<Shared>, req: Request<Incoming>, peer: &str, action: &str) -> Result<Resp, Resp> {
    if req.method() != Method::PUT {
        return Err(text(StatusCode::METHOD_NOT_ALLOWED, "use PUT"));
    }
    let peer =
        percent_decode(peer).filter(|p| !p.is_empty()).ok_or_else(|| text(StatusCode::BAD_REQUEST, "bad peer name"))?;
    let written = match action {
        "register" => {
            let body: RegisterRequest = read_json(req, false).await?.unwrap_or_default();
            shared.write_catalog(|c| c.register_imported(&peer, body))
        }
        "deregister" => {
            let body: DeregisterRequest = read_json(req, false).await?.unwrap_or_default();
            shared.write_catalog(|c| c.deregister_imported(&peer, body))
        }
        _ => return Err(text(StatusCode::NOT_FOUND, "unknown control endpoint")),
    };
    match written {
        Ok(_) => Ok(json(StatusCode::OK, &true)),
        Err(e) => Err(text(StatusCode::BAD_REQUEST, e.to_string())),
    }
}

/// The control endpoints whose paths carry no name.
async fn fixed_endpoint(shared: &Arc<Shared>, req: Request<Incoming>, path: &str, query: &str) -> Result<Resp, Resp> {
    match (req.method().clone(), path) {
        (Method::GET, "/_sim/faults") => Ok(json(StatusCode::OK, &shared.faults())),
        (Method::PUT, "/_sim/faults") => {
            let patch: FaultsPatch = read_json(req, false).await?.unwrap_or_default();
            Ok(json(StatusCode::OK, &shared.set_faults(patch)))
        }
        (Method::DELETE, "/_sim/faults") => Ok(json(StatusCode::OK, &shared.clear_faults())),
        (Method::POST, "/_sim/drop-blocking") => {
            Ok(json(StatusCode::OK, &serde_json::json!({"dropped": shared.drop_blocking()})))
        }
        (Method::POST, "/_sim/reset-index") => {
            let body: Option<IndexBody> = read_json(req, true).await?;
            let index = body.map_or(1, |b| b.index);
            shared.reset_indexes(index);
            Ok(json(StatusCode::OK, &serde_json::json!({"index": index})))
        }
        (Method::GET, "/_sim/requests") => {
            let mut records = shared.requests();
            if let Some(prefix) = query_param(query, "path_prefix") {
                records.retain(|r| r.path.starts_with(&prefix));
            }
            Ok(json(StatusCode::OK, &records))
        }
        (Method::DELETE, "/_sim/requests") => {
            Ok(json(StatusCode::OK, &serde_json::json!({"cleared": shared.clear_requests()})))
        }
        (Method::GET, "/_sim/stats") => Ok(json(StatusCode::OK, &shared.stats())),
        (Method::DELETE, "/_sim/stats") => {
            shared.reset_stats();
            Ok(json(StatusCode::OK, &shared.stats()))
        }
        (_, "/_sim/faults" | "/_sim/drop-blocking" | "/_sim/reset-index" | "/_sim/requests" | "/_sim/stats") => {
            Err(text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"))
        }
        _ => Err(text(StatusCode::NOT_FOUND, "unknown control endpoint")),
    }
}
