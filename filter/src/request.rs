//! The glue between proxy-wasm's callbacks for one HTTP exchange and the exchange's state
//! machine (`crate::exchange`): each callback runs the exchange's event against Envoy as its
//! [`Host`](crate::exchange::Host) and answers what it decided. Nothing is decided here.

use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::Gateway;
use crate::exchange::Exchange;
use crate::host::{self, Envoy};

pub struct Request {
    exchange: Exchange,
    envoy: Envoy,
}

impl Request {
    pub fn new(gw: Rc<Gateway>, context_id: u32) -> Self {
        Request {
            envoy: Envoy::of_request(Rc::clone(&gw), context_id),
            exchange: Exchange::new(gw),
        }
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        host::callback("lease", || {
            self.exchange.on_lease(&self.envoy, token, body_size);
            self.exchange.on_run_reserved(&self.envoy, token, body_size);
        });
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        host::callback("request_headers", || {
            self.exchange.on_headers(&self.envoy, end_of_stream)
        })
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        host::callback("request_body", || {
            self.exchange.on_body(&self.envoy, size, end_of_stream)
        })
    }

    fn on_http_request_trailers(&mut self, _: usize) -> Action {
        host::callback("request_trailers", || {
            self.exchange.on_trailers(&self.envoy)
        })
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        host::callback("response_headers", || {
            self.exchange
                .on_response_headers(&self.envoy, end_of_stream)
        })
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        host::callback("response_body", || {
            self.exchange
                .on_response_body(&self.envoy, size, end_of_stream)
        })
    }

    fn on_http_response_trailers(&mut self, _: usize) -> Action {
        host::callback("response_trailers", || {
            self.exchange.on_response_trailers(&self.envoy)
        })
    }

    fn on_log(&mut self) {
        host::callback("log", || self.exchange.on_log(&self.envoy));
        host::report_stages();
    }
}
