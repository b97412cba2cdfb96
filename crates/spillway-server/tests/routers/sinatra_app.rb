# Sinatra 3 on Rack 2.2 and WEBrick (Debian's ruby-sinatra, ruby-rack,
# ruby-webrick) as an upstream of tests/proxy_routers.rs: Sinatra's router
# (Mustermann patterns on PATH_INFO), its default method override
# (Rack::MethodOverride: `_method` in a POST form body and the
# X-HTTP-Method-Override header), and virtual hosts by `request.host`
# (Rack::Request, which believes X-Forwarded-Host).
#
# The upstream protocol: `ruby sinatra_app.rb LOG` listens on a free
# loopback port, prints {"port": N} on its first line, appends
# "case<TAB>handler<TAB>method<TAB>path" to LOG for every request it routes
# (the case is the X-Case header), answers with the handler's name, and
# exits when its standard input closes.

require 'json'
require 'logger'
require 'sinatra/base'
require 'webrick'

LOG = File.open(ARGV.fetch(0), 'a')
LOG.sync = true

class Upstream < Sinatra::Base
  set :method_override, true
  set :show_exceptions, false
  set :logging, false
  # Sinatra 3 refuses hosts not in this list in development only; the
  # upstream is run as in production.
  set :environment, :production

  helpers do
    def handled(name)
      LOG.write("#{request.env['HTTP_X_CASE']}\t#{name}\t#{request.request_method}\t#{request.path_info}\n")
      headers 'X-Handler' => name
      name
    end
  end

  before do
    halt handled('admin') if request.host == 'admin.example.com'
  end

  post('/login') { handled('login') }
  get('/report') { handled('report') }
  delete('/account') { handled('account') }
  %w[get post put patch delete options].each do |verb|
    send(verb, '/*') { handled('other') }
  end
  route('HEAD', '/*') { handled('other') }
end

server = WEBrick::HTTPServer.new(
  BindAddress: '127.0.0.1',
  Port: 0,
  Logger: WEBrick::Log.new(File::NULL),
  AccessLog: []
)
server.mount('/', Rack::Handler::WEBrick, Upstream.new)
$stdout.puts({ port: server.config[:Port] }.to_json)
$stdout.flush
Thread.new { server.start }
$stdin.read
server.shutdown
